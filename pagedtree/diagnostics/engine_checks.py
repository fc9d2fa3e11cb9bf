"""Checks 2 and 3: greedy tokens of the engine, compared run against run.

- CUDA graphs against eager steps: the same greedy tokens with decode and verify
  steps replayed as CUDA graphs and with ``enforce_eager`` (plain decoding, and tree
  speculation, whose verify steps and draft levels have graphs of their own). On a
  CPU the graph runs take the same padded static steps without capturing them.
- Tree speculation against plain decoding, in bf16: greedy outputs must be equal
  token for token (a tree pass and a one-token decode must give a token the same
  logits).
- Overlapping launches (``launch_overlap``, sm_90 and later) against launches one
  after another: the same greedy tokens, graphs captured with them, for plain
  decoding and tree speculation (the kernels' arithmetic does not change, only when
  their programs start).

Every run asks for the top-2 logprobs, so a difference is reported with the
reference run's gap between its two best tokens there: a gap near bf16 rounding
points at a near-tie, a wide one at a bug.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

import torch

from pagedtree.config import SpeculativeConfig
from pagedtree.diagnostics.report import FAIL, INFO, PASS, Row, failed_run, skipped
from pagedtree.executor.shards import DRAFT_GRAPH_TOKENS

GRAPHS = "cuda graphs vs eager"
ASYNC = "async vs ordered steps"
SPECULATION = "speculative vs plain"
FLASHINFER = "FlashInfer in the engine"
OVERLAP = "overlapping launches"
# On a GPU, verify steps of up to 16 nodes and their root (token buckets 1, 2, 4, 8
# and 17); in the interpreter, small trees (every padded token is interpreted).
CUDA_TREE = SpeculativeConfig(tree="static", expansion=(2, 2, 2, 1), max_nodes=16, adaptive=False)
CPU_TREE = SpeculativeConfig(tree="static", expansion=(2, 1, 1), max_nodes=4, adaptive=False)
# A chain: on a GPU its levels are fed from the device and read back at once.
CHAIN = SpeculativeConfig(tree="chain", depth=4, max_nodes=4, adaptive=False)


def tree_name(config: SpeculativeConfig) -> str:
    """A tree configuration in a few words, e.g. ``16-node static tree 2,2,2,1``."""
    if config.tree == "chain":
        return f"chain of {config.depth}"
    return f"{config.max_nodes}-node {config.tree} tree {','.join(map(str, config.expansion))}"


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """What every engine run of the checks shares: models, device, dtype, prompts."""

    target: str
    draft: str
    device: str  # "cuda" or "cpu"
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    max_num_seqs: int
    num_kv_blocks: int
    dtype: str = "bfloat16"
    block_size: int = 16
    max_model_len: int = 256
    speculative: SpeculativeConfig = field(default_factory=lambda: CUDA_TREE)

    @property
    def total_tokens(self) -> int:
        """Tokens a run generates over all prompts."""
        return len(self.prompts) * self.max_tokens


def short_dtype(dtype: str) -> str:
    """``bf16`` for ``bfloat16`` and so on."""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


def random_prompts(count: int, min_len: int, max_len: int, seed: int, vocab: int = 256) -> tuple[tuple[int, ...], ...]:
    """``count`` token-id prompts of random lengths (ids 3..vocab-1: no special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return tuple(tuple(torch.randint(3, vocab, (n,), generator=gen).tolist()) for n in lengths)


def engine_setup(device_type: str, quick: bool, target: str, draft: str, seed: int = 0) -> EngineSetup:
    """The runs' sizes for ``device_type``: a batch of 8 prompts (4 with ``quick``) of
    up to 40 tokens and 16-node trees on a GPU; 3 (2) short prompts and 4-node trees
    in the interpreter."""
    if device_type == "cuda":
        count, tokens = (4, 16) if quick else (8, 32)
        return EngineSetup(target, draft, "cuda", random_prompts(count, 4, 40, seed), tokens,
                           max_num_seqs=8, num_kv_blocks=256, speculative=CUDA_TREE)
    count, tokens = (2, 6) if quick else (3, 10)
    return EngineSetup(target, draft, "cpu", random_prompts(count, 3, 12, seed), tokens,
                       max_num_seqs=count, num_kv_blocks=64, speculative=CPU_TREE)


def make_llm(setup: EngineSetup, speculative: bool | SpeculativeConfig, graphs: bool,
             asynchronous: bool | None = None, backend: str = "triton"):
    """An ``LLM`` on the Triton backend (or ``backend``, eager), with tree speculation
    (the setup's tree, or the configuration given) or not, with CUDA
    graphs (on a CPU: the padded static steps graphs replay, uncaptured) or eager,
    and with plain steps launched ahead of their readback or not (None: the device's
    default)."""
    from pagedtree import LLM

    graphs = graphs and backend == "triton"
    kwargs: dict = dict(device=setup.device, dtype=setup.dtype, attention_backend=backend,
                        block_size=setup.block_size, max_num_seqs=setup.max_num_seqs,
                        max_model_len=setup.max_model_len, num_kv_blocks=setup.num_kv_blocks, seed=0,
                        enforce_eager=setup.device != "cuda" or not graphs, async_scheduling=asynchronous)
    tree = setup.speculative if speculative is True else speculative or None
    if tree is not None:
        kwargs.update(draft_model=setup.draft, speculative=tree)
    llm = LLM(setup.target, **kwargs)
    if setup.device != "cuda" and graphs:
        engine = llm.engine
        tree_tokens = 1 + tree.max_nodes if tree is not None else 1
        engine.runner.enable_cuda_graphs(setup.max_num_seqs, engine.max_model_len, tree_tokens, capture=False)
        for draft in engine.speculation.drafts:
            draft.runner.enable_cuda_graphs(setup.max_num_seqs * 4, engine.max_model_len, DRAFT_GRAPH_TOKENS,
                                                 capture=False)
    return llm


def release(llm) -> None:
    """Shut ``llm`` down and give the device memory of what is no longer referenced back."""
    llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(slots=True)
class RunResult:
    """Greedy tokens of one run, the top-2 logprob gap at every token, and what the
    run did: padded (graph) steps, graphs captured, draft tokens and accepted ones."""

    tokens: list[list[int]]
    gaps: list[list[float]]
    graph_steps: int = 0
    graphs_captured: int = 0
    graphs_active: bool = False
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps_ahead: int = 0  # plain steps launched before the previous one was read back
    whole_drafts: int = 0  # drafts run as one static program (one graph replay on CUDA)
    draft_graphs_captured: int = 0


def top2_gap(logprobs: dict[int, float] | None) -> float:
    """The logprob gap between the two best tokens of a position (inf when unknown)."""
    if not logprobs or len(logprobs) < 2:
        return float("inf")
    best = sorted((float(getattr(v, "logprob", v)) for v in logprobs.values()), reverse=True)
    return best[0] - best[1]


def greedy_run(setup: EngineSetup, speculative: bool | SpeculativeConfig, graphs: bool,
               asynchronous: bool | None = None, backend: str = "triton", overlap: bool | None = None) -> RunResult:
    """Generate greedily for every prompt (EOS ignored) and collect the run's result;
    ``overlap`` switches overlapping launches on or off for the whole run (None:
    as the process has it)."""
    from pagedtree import SamplingParams
    from pagedtree.kernels import launch_overlap

    with launch_overlap.overlapping(launch_overlap.enabled() if overlap is None else overlap):
        llm = make_llm(setup, speculative, graphs, asynchronous, backend)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=setup.max_tokens, ignore_eos=True, logprobs=2)
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in setup.prompts], params, use_tqdm=False)
            result = RunResult(tokens=[list(o.outputs[0].token_ids) for o in outs],
                               gaps=[[top2_gap(lp) for lp in (o.outputs[0].logprobs or [])] for o in outs])
            _record_graphs(llm, result)
            stats = llm.stats()
            result.draft_tokens = int(stats.get("num_draft_tokens", 0))
            result.accepted_tokens = int(stats.get("num_accepted_tokens", 0))
            result.steps_ahead = llm.engine.async_steps.num_steps_ahead
            return result
        finally:
            release(llm)


def _record_graphs(llm, result: RunResult) -> None:
    runners = [llm.engine.runner]
    runners += [d.runner for d in llm.engine.speculation.drafts]
    graphs = [r.graphs for r in runners if getattr(r, "graphs", None) is not None]
    result.graphs_active = len(graphs) == len(runners)
    result.graph_steps = sum(g.num_steps for g in graphs)
    result.graphs_captured = sum(len(getattr(g, "_graphs", {})) for g in graphs)
    drafts = [g.drafts for g in graphs if getattr(g, "drafts", None) is not None]
    result.whole_drafts = sum(d.num_drafts for d in drafts)
    result.draft_graphs_captured = sum(d.num_captures for d in drafts)


class EngineRuns:
    """The runs of checks 2 and 3, each made once and shared by both checks."""

    def __init__(self, setup: EngineSetup):
        self.setup = setup
        self._runs: dict[tuple, RunResult] = {}

    def get(self, speculative: bool | SpeculativeConfig, graphs: bool, asynchronous: bool | None = None,
            backend: str = "triton", overlap: bool | None = None) -> RunResult:
        """The run with tree speculation (the setup's tree, or the configuration given)
        or not, graphs or eager, plain steps ahead of their readback or not (None: the
        device's default), on an attention backend, with launches overlapping or not
        (None: as the process has it); made on first use."""
        from pagedtree.kernels import launch_overlap

        if overlap is None:  # the process's setting: the same run as naming it
            overlap = launch_overlap.enabled()
        key = (speculative if isinstance(speculative, bool) else tree_name(speculative), graphs, asynchronous,
               backend, overlap)
        if key not in self._runs:
            self._runs[key] = greedy_run(self.setup, speculative, graphs, asynchronous, backend, overlap)
        return self._runs[key]


@dataclass(slots=True)
class TokenComparison:
    """Two runs' tokens side by side: how many agree, and the first difference with
    the reference run's top-2 gap there."""

    equal: int
    total: int
    first_difference: tuple[int, int] | None = None  # (prompt, token position)
    gap: float | None = None

    @property
    def same(self) -> bool:
        """Whether every token of every prompt agrees."""
        return self.first_difference is None and self.equal == self.total

    def describe(self) -> str:
        """``N/N tokens equal`` or where the first difference is."""
        if self.same:
            return f"{self.equal}/{self.total} tokens equal"
        prompt, pos = self.first_difference or (-1, -1)
        gap = f", top-2 gap {self.gap:.3g}" if self.gap is not None and self.gap != float("inf") else ""
        return f"{self.equal}/{self.total} equal; prompt {prompt} differs at token {pos}{gap}"


def compare_tokens(reference: RunResult, other: RunResult) -> TokenComparison:
    """Token-for-token comparison of ``other`` against ``reference``."""
    equal = total = 0
    first = gap = None
    for i, (ref, got) in enumerate(zip(reference.tokens, other.tokens)):
        total += max(len(ref), len(got))
        equal += sum(a == b for a, b in zip(ref, got))
        if ref != got and first is None:
            pos = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            first = (i, pos)
            gaps = reference.gaps[i] if i < len(reference.gaps) else []
            gap = gaps[pos] if pos < len(gaps) else None
    if len(reference.tokens) != len(other.tokens) and first is None:
        first = (min(len(reference.tokens), len(other.tokens)), 0)
    return TokenComparison(equal, total, first, gap)


def graph_rows(runs: EngineRuns) -> list[Row]:
    """Check 2's rows: graphs against eager, for plain decoding and tree speculation."""
    setup = runs.setup
    cuda = setup.device == "cuda"
    rows = []
    for speculative, name in ((False, "decode"), (True, f"tree speculation ({tree_name(setup.speculative)})")):
        case = f"{name}, {short_dtype(setup.dtype)}" + ("" if cuda else ", static steps uncaptured")
        try:
            eager, graphed = runs.get(speculative, False), runs.get(speculative, True)
        except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
            rows.append(failed_run(GRAPHS, case, exc))
            continue
        rows.append(_graph_row(case, eager, graphed, cuda))
    if not cuda:
        rows.append(skipped(GRAPHS, "captured replay", "no CUDA"))
    return rows + [async_row(runs)]


def async_row(runs: EngineRuns) -> Row:
    """Plain decoding with each step launched before the previous one is read back
    against one step at a time (graphs as the device runs them): the same tokens,
    and steps really launched ahead."""
    setup = runs.setup
    graphs = setup.device == "cuda"
    case = f"decode, {short_dtype(setup.dtype)}" + (", graphs" if graphs else ", static steps uncaptured")
    try:
        ordered, ahead = runs.get(False, graphs, False), runs.get(False, graphs, True)
    except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
        return failed_run(ASYNC, case, exc)
    comparison = compare_tokens(ordered, ahead)
    figure = f"{ahead.steps_ahead} steps launched ahead of a readback"
    if ahead.steps_ahead == 0:
        return Row(ASYNC, case, "no step was launched ahead", figure, FAIL, _detail(comparison, ahead))
    return Row(ASYNC, case, comparison.describe(), figure, PASS if comparison.same else FAIL,
               _detail(comparison, ahead))


def _graph_row(case: str, eager: RunResult, graphed: RunResult, cuda: bool) -> Row:
    comparison = compare_tokens(eager, graphed)
    used = graphed.graphs_active and graphed.graph_steps > 0 and (graphed.graphs_captured > 0 or not cuda)
    figure = f"{graphed.graph_steps} padded steps" + (f", {graphed.graphs_captured} graphs captured" if cuda else "")
    if graphed.whole_drafts:
        figure += f", {graphed.whole_drafts} whole draft{'s' if graphed.whole_drafts != 1 else ''}" + (
            f" ({graphed.draft_graphs_captured} graphs captured)" if cuda else "")
    if graphed.draft_tokens or eager.draft_tokens:
        # Verification keeps the tokens whatever was drafted: a draft the graphs got
        # wrong shows in what was accepted, not in the tokens.
        figure += f"; accepted {graphed.accepted_tokens} of {graphed.draft_tokens} drafted (eager " \
                  f"{eager.accepted_tokens} of {eager.draft_tokens})"
    if not used:
        result = "graphs not used (capture failed or no step fit a shape)"
        return Row(GRAPHS, case, result, figure, FAIL, _detail(comparison, graphed))
    verdict = PASS if comparison.same else FAIL
    return Row(GRAPHS, case, comparison.describe(), figure, verdict, _detail(comparison, graphed))


def speculation_rows(runs: EngineRuns) -> list[Row]:
    """Check 3's rows: greedy tree speculation against plain decoding, with the
    device's default step path (graphs on a GPU), for the setup's tree and a chain
    (whose levels a GPU feeds from the device and reads back at once)."""
    setup = runs.setup
    graphs = setup.device == "cuda"
    rows = []
    for tree in (setup.speculative, CHAIN):
        case = f"greedy, {short_dtype(setup.dtype)}, {tree_name(tree)}"
        try:
            plain, spec = runs.get(False, graphs), runs.get(True if tree is setup.speculative else tree, graphs)
        except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
            rows.append(failed_run(SPECULATION, case, exc))
            continue
        comparison = compare_tokens(plain, spec)
        figure = f"{spec.draft_tokens} draft tokens, {spec.accepted_tokens} accepted"
        if spec.draft_tokens == 0:
            rows.append(Row(SPECULATION, case, "no tree was drafted", figure, FAIL, _detail(comparison, spec)))
            continue
        verdict = PASS if comparison.same else FAIL
        rows.append(Row(SPECULATION, case, comparison.describe(), figure, verdict, _detail(comparison, spec)))
    return rows


def flashinfer_rows(runs: EngineRuns) -> list[Row]:
    """FlashInfer attending in the engine (eager steps), where it runs: its plain greedy
    tokens against the Triton kernels' eager ones, and its tree speculation against
    its own plain decoding. Informational: FlashInfer is not batch-invariant, so a
    near-tie may go either way; the first difference's top-2 gap says whether it was
    one (a wide gap is a wrong result)."""
    from pagedtree.attention.flashinfer_backend import FlashInferPagedAttention

    setup = runs.setup
    reason = FlashInferPagedAttention.unavailable(torch.device(setup.device), getattr(torch, setup.dtype))
    if reason is not None:
        return [skipped(FLASHINFER, "FlashInfer against the Triton kernels", reason)]
    rows = []
    plain, flashinfer = (False, False), (False, False, None, "flashinfer")
    pairs = [("plain greedy: FlashInfer vs the Triton kernels, eager", plain, flashinfer),
             (f"greedy, {tree_name(setup.speculative)}: speculative vs plain on FlashInfer", flashinfer,
              (True, False, None, "flashinfer"))]
    for case, reference_args, other_args in pairs:
        try:
            reference, other = runs.get(*reference_args), runs.get(*other_args)
        except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
            rows.append(failed_run(FLASHINFER, case, exc))
            continue
        comparison = compare_tokens(reference, other)
        figure = f"{other.draft_tokens} draft tokens, {other.accepted_tokens} accepted" if other.draft_tokens else ""
        rows.append(Row(FLASHINFER, case, comparison.describe(), figure, INFO, _detail(comparison, other)))
    return rows


def overlap_rows(runs: EngineRuns) -> list[Row]:
    """Greedy tokens with launches overlapping against launches one after another,
    graphs captured under each (plain decoding and the setup's tree), where the GPU
    can overlap them; a skipped row elsewhere."""
    from pagedtree.kernels import launch_overlap

    setup = runs.setup
    if not launch_overlap.supported(torch.device(setup.device)):
        return [skipped(OVERLAP, "overlapping against one after another", "needs a CUDA GPU of sm_90 or later")]
    cuda = setup.device == "cuda"
    rows = []
    for speculative, name in ((False, "decode"), (True, f"tree speculation ({tree_name(setup.speculative)})")):
        case = f"{name}, {short_dtype(setup.dtype)}, graphs"
        try:
            apart, overlapped = runs.get(speculative, True, overlap=False), runs.get(speculative, True, overlap=True)
        except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
            rows.append(failed_run(OVERLAP, case, exc))
            continue
        rows.append(dataclasses.replace(_graph_row(case, apart, overlapped, cuda), check=OVERLAP))
    return rows


def _detail(comparison: TokenComparison, run: RunResult) -> dict:
    return dict(equal=comparison.equal, total=comparison.total, first_difference=comparison.first_difference,
                top2_gap=comparison.gap, graph_steps=run.graph_steps, graphs_captured=run.graphs_captured,
                draft_tokens=run.draft_tokens, accepted_tokens=run.accepted_tokens, whole_drafts=run.whole_drafts,
                draft_graphs_captured=run.draft_graphs_captured)

