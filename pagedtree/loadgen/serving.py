"""Serving benchmark: send a dataset's prompts to a running server and measure latencies.

    python -m pagedtree.loadgen.serving --backend openai --base-url http://127.0.0.1:8000 \\
        --model qwen2.5-coder-0.5b-instruct --dataset random --input-len 128 --output-len 64 \\
        --num-prompts 50 --request-rate 4 --ignore-eos --save-result out.json

Requests start at Poisson arrival times (``--request-rate``, seeded; ``inf`` sends all
at once), at most ``--max-concurrency`` in flight. Every request streams; TTFT,
TPOT, ITL and E2EL come from the client's chunk arrival times (definitions in
``pagedtree.loadgen.serving_metrics``). One warm-up request runs first and is not counted.
From Python: ``await run_benchmark(BenchmarkConfig(...))`` returns the same dict
``--save-result`` writes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from tqdm.auto import tqdm

from pagedtree.loadgen import datasets
from pagedtree.loadgen.backends import BACKENDS, RequestFunc, RequestInput, served_model_name
from pagedtree.loadgen.serving_metrics import METRICS, RequestRecord, parse_slos, summarize
from pagedtree.loading.packaged_models import ModelNotInstalledError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_PROMPTS = 100
DEFAULT_TIMEOUT_S = 3600.0


class WarmupFailed(RuntimeError):
    """The warm-up request failed: the server is unreachable or refuses the requests."""


@dataclass
class BenchmarkConfig:
    """Every option of a run (the command line's flags, in snake case)."""

    backend: str = "openai"
    base_url: str = DEFAULT_BASE_URL
    model: str | None = None
    tokenizer: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    input_len: int = datasets.DEFAULT_INPUT_LEN
    output_len: int | None = None  # None: the dataset's (128 for random and file, the replies for ShareGPT)
    range_ratio: float = 0.0
    num_prompts: int = DEFAULT_NUM_PROMPTS
    request_rate: float = math.inf
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: ttft, tpot, e2el
    save_result: str | None = None
    disable_tqdm: bool = False
    timeout: float | None = DEFAULT_TIMEOUT_S
    warmup: bool = True
    api_key: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not (self.request_rate > 0):
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")
        parse_slos(f"{k}:{v}" for k, v in self.goodput.items())

    def to_json(self) -> dict[str, Any]:
        """The options as strict JSON (an infinite rate reads ``"inf"``; no API key)."""
        out = asdict(self)
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        out["api_key"] = None if self.api_key is None else "***"
        return out


# -------------------------------------------------------------- arrivals
def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: Poisson arrivals (exponential gaps) at ``request_rate``.

    The first request goes at 0; an infinite rate sends every request at 0.
    """
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


async def run_requests(send: Callable[[RequestInput], Awaitable[RequestRecord]], inputs: Sequence[RequestInput],
                       offsets: Sequence[float], max_concurrency: int | None = None,
                       progress: tqdm | None = None) -> tuple[list[RequestRecord], float]:
    """Send ``inputs[i]`` at ``offsets[i]`` through ``send`` (an async ``RequestInput -> RequestRecord``).

    At most ``max_concurrency`` requests are in flight; one that arrives while the
    limit is reached waits, and its send time (hence its TTFT) starts when it is
    actually sent, as in vLLM. Returns the records in input order and the duration
    from the start to the last request's end.
    """
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(inp: RequestInput, offset: float) -> RequestRecord:
        # Absolute deadlines from one start: sleeps' overshoot does not accumulate.
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            record = await send(inp)
        else:
            async with limit:
                record = await send(inp)
        if progress is not None:
            progress.update(1)
        return record

    records = await asyncio.gather(*(one(inp, off) for inp, off in zip(inputs, offsets)))
    return list(records), time.perf_counter() - start


# ------------------------------------------------------------------- run
def _inputs(config: BenchmarkConfig, samples: Sequence[datasets.SampleRequest], model: str | None) -> list[RequestInput]:
    return [
        RequestInput(prompt=s.prompt, output_len=s.output_len, prompt_len=s.prompt_len, model=model,
                     temperature=config.temperature, ignore_eos=config.ignore_eos, api_key=config.api_key,
                     timeout=config.timeout)
        for s in samples
    ]


def _count_missing_outputs(records: Sequence[RequestRecord], tokenizer: Any | None) -> None:
    """Where the server gave no token count, count the text's tokens (better than one per chunk)."""
    if tokenizer is None:
        return
    for r in records:
        if r.success and r.output_tokens_source == "chunks":
            r.output_tokens = datasets.count_tokens(tokenizer, r.generated_text)
            r.output_tokens_source = "tokenizer"


async def run_benchmark(config: BenchmarkConfig | dict[str, Any],
                        requests: Sequence[datasets.SampleRequest] | None = None) -> dict[str, Any]:
    """Run one benchmark and return ``{"date", "config", "summary", "requests", "warmup", "errors"}``.

    ``config`` may be a ``BenchmarkConfig`` or a dict of its fields. ``requests``
    replaces the dataset (the same prompts can then go to several servers). Writes
    ``config.save_result`` when set. Raises ``ValueError`` on bad options and
    ``WarmupFailed`` when the warm-up request fails.
    """
    if isinstance(config, dict):
        config = BenchmarkConfig(**config)
    config.validate()
    tokenizer = datasets.load_tokenizer(config.tokenizer, config.model)
    if requests is None:
        requests = datasets.build_requests(
            config.dataset, tokenizer, config.num_prompts, dataset_path=config.dataset_path,
            input_len=config.input_len, output_len=config.output_len, range_ratio=config.range_ratio,
            seed=config.seed,
        )
    if not requests:
        raise ValueError("no requests to send")
    if config.ignore_eos and config.backend == "tgi":
        print("note: TGI has no ignore-EOS option; --ignore-eos is not sent and outputs may end early",
              file=sys.stderr)
    request_fn: RequestFunc = BACKENDS[config.backend]
    # No connection limit here: --max-concurrency is the one knob on what is in flight.
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        model = config.model
        if model is None and config.backend == "openai":
            model = await served_model_name(session, config.base_url, config.api_key)
        inputs = _inputs(config, requests, model)

        async def send(inp: RequestInput) -> RequestRecord:
            return await request_fn(session, config.base_url, inp)

        warmup = None
        if config.warmup:
            warmup = await send(inputs[0])
            if not warmup.success:
                raise WarmupFailed(f"the warm-up request to {config.base_url} failed: {warmup.error}")
        offsets = arrival_offsets(len(inputs), config.request_rate, config.seed)
        with tqdm(total=len(inputs), disable=config.disable_tqdm, desc="requests") as bar:
            records, duration = await run_requests(send, inputs, offsets, config.max_concurrency, bar)
    _count_missing_outputs(records, tokenizer)
    if warmup is not None:
        _count_missing_outputs([warmup], tokenizer)
    summary = summarize(records, duration, config.goodput)
    errors: dict[str, int] = {}
    for r in records:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": config.to_json() | {"model": model},
        "summary": summary.as_dict(),
        "errors": errors,
        "requests": [r.to_dict() for r in records],
        "warmup": warmup.to_dict() if warmup is not None else None,
    }
    if config.save_result:
        path = Path(config.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return result


# ----------------------------------------------------------------- table
def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency (per chunk)", "e2el": "End-to-end Latency"}


def format_table(result: dict[str, Any]) -> str:
    """The summary as a readable table (``n/a`` where a statistic has no values)."""
    s = result["summary"]
    cfg = result["config"]
    width = 56
    rows = [
        " Serving Benchmark Result ".center(width, "="),
        f"{'Backend:':<40}{cfg['backend']} {cfg['base_url']}",
        f"{'Request rate (req/s):':<40}{cfg['request_rate']}",
        f"{'Max concurrency:':<40}{cfg['max_concurrency'] or 'no limit'}",
        f"{'Successful requests:':<40}{s['completed']}",
        f"{'Failed requests:':<40}{s['failed']}",
        f"{'Benchmark duration (s):':<40}{_fmt(s['duration_s'])}",
        f"{'Total input tokens:':<40}{s['total_input_tokens']}",
        f"{'Total generated tokens:':<40}{s['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{_fmt(s['request_throughput'])}",
        f"{'Output token throughput (tok/s):':<40}{_fmt(s['output_throughput'])}",
        f"{'Total token throughput (tok/s):':<40}{_fmt(s['total_token_throughput'])}",
    ]
    if s["goodput_slos_ms"]:
        slos = " ".join(f"{k}:{v:g}" for k, v in s["goodput_slos_ms"].items())
        rows.append(f"{'Request goodput (req/s), ' + slos + ':':<40}{_fmt(s['goodput'])}")
    for name in METRICS:
        rows.append(f" {_NAMES[name]} ".center(width, "-"))
        label = name.upper()
        for stat, title in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99"), ("std", "Std")):
            rows.append(f"{f'{title} {label} (ms):':<40}{_fmt(s[f'{stat}_{name}_ms'])}")
    rows.append("=" * width)
    for error, count in list(result["errors"].items())[:5]:
        rows.append(f"{count} failed: {error}")
    return "\n".join(rows)


# ------------------------------------------------------------------- CLI
def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return value


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's argument parser."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="openai", choices=list(BACKENDS),
                   help="openai: POST /v1/completions; tgi: POST /generate_stream (default: openai)")
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"server URL (default: {DEFAULT_BASE_URL})")
    p.add_argument("--model", default=None,
                   help="model name sent to the server (openai; default: the first of /v1/models); "
                        "also the tokenizer when it names a local folder or an installed packaged model")
    p.add_argument("--tokenizer", default=None, help="tokenizer: HF folder or pagedtree packaged model name")
    p.add_argument("--dataset", default="random", choices=list(datasets.DATASETS))
    p.add_argument("--dataset-path", default=None, help="file for sharegpt-json and file datasets")
    p.add_argument("--input-len", type=int, default=datasets.DEFAULT_INPUT_LEN,
                   help=f"random: prompt tokens (default: {datasets.DEFAULT_INPUT_LEN})")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"tokens to ask for (default: {datasets.DEFAULT_OUTPUT_LEN}; ShareGPT: the reply's length)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths drawn from [len*(1-r), len*(1+r)] (default: 0)")
    p.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help=f"default: {DEFAULT_NUM_PROMPTS}")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests/s, Poisson arrivals; inf sends all at once (default: inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate the asked tokens (openai only)")
    p.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrival times")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    p.add_argument("--save-result", default=None, metavar="PATH.json",
                   help="write the summary, the config and every request's record")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds per request (default: {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up request")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    return p


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """A ``BenchmarkConfig`` from parsed arguments (``ValueError`` on a bad SLO)."""
    return BenchmarkConfig(
        backend=args.backend, base_url=args.base_url, model=args.model, tokenizer=args.tokenizer,
        dataset=args.dataset, dataset_path=args.dataset_path, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, num_prompts=args.num_prompts,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, temperature=args.temperature,
        ignore_eos=args.ignore_eos, seed=args.seed, goodput=parse_slos(args.goodput or []),
        save_result=args.save_result, disable_tqdm=args.disable_tqdm, timeout=args.timeout,
        warmup=not args.no_warmup, api_key=args.api_key,
    )


def _run(coro: Any) -> Any:
    """Run on uvloop when it is there: less client overhead in the measured times."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is None or not hasattr(asyncio, "Runner"):  # asyncio.Runner: Python 3.11+
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Command-line entry point: 0 when the run completed (failed requests are in the table),
    1 when the warm-up request failed, 2 on bad options or input files."""
    args = build_parser(prog).parse_args(argv)
    try:
        config = config_from_args(args)
        result = _run(run_benchmark(config))
    except WarmupFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError, ModelNotInstalledError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if config.save_result:
        print(f"saved {config.save_result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
