"""Check 1: the Triton attention kernel against the float64 reference.

Every case is one launch of ``unified_attention`` with the tile shape the launch
code picks on this device (``default_tile_shape``: the GPU's own choice on a GPU),
over a random paged cache with shuffled block tables, holding three requests:

- a token tree of ``query_len`` tokens: a root (the last committed token) and
  ``query_len - 1`` nodes with random parents, as a verify step has;
- a causal run of ``query_len`` tokens (a prefill chunk after a short prefix);
- a decode (one token).

The tolerance is what 16-bit arithmetic allows (unit roundoff ``u``: 2**-11 for
fp16, 2**-8 for bf16): the probabilities are rounded to 16 bits before they meet the
values (at most ``u * max|v|``) and the output is rounded once more (again at most
``u * max|v|``), so ``atol = 2 u max|v|`` plus fp32 noise, with ``rtol = 0``.

On a GPU the full matrix is 256 launches, each its own compiled specialisation; the
cases run in worker processes (``case_workers``), so that their compiles overlap and
a launch that crashes (an illegal address leaves a CUDA context unusable) or hangs
fails its own case, not the rest of the report.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from pagedtree.diagnostics.case_workers import run_in_workers
from pagedtree.diagnostics.reference import paged_reference
from pagedtree.diagnostics.report import FAIL, PASS, Row
from pagedtree.kernels.cuda_compile import pairwise

CHECK = "kernel vs reference"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
FP32_NOISE = 1e-4
NUM_KV_HEADS = 2
CASE_TIMEOUT_S = 300.0  # one launch, its compile included


@dataclass(frozen=True, slots=True)
class KernelMatrix:
    """The dimensions of the case matrix; ``cover`` is ``"all"`` (every combination)
    or ``"pairwise"`` (every pair of values of two dimensions at least once)."""

    dtypes: tuple[str, ...]
    groups: tuple[int, ...]  # query heads per KV head
    block_sizes: tuple[int, ...]
    query_lens: tuple[int, ...]
    head_dims: tuple[int, ...]
    cover: str = "all"
    long_prefix: int = 0  # prefix of the long-context cases (0: none); long enough for split-KV

    def describe(self) -> str:
        """The matrix in one line, e.g. ``fp16,bf16 x G 1-8 x bs 16,32 x ...``."""
        def join(values: Sequence) -> str:
            return ",".join(map(str, values))
        text = (f"{join(self.dtypes)} x G {join(self.groups)} x bs {join(self.block_sizes)} x "
                f"runs {join(self.query_lens)} x D {join(self.head_dims)}")
        return text + (" (pairwise)" if self.cover == "pairwise" else "")


# On a GPU: the shapes the engine runs. Runs of 16/17 and 64/65 tokens cross the
# power-of-two and tree/prefill boundaries of the tile choice (65 = 64 nodes + root).
CUDA_FULL = KernelMatrix(("fp16", "bf16"), tuple(range(1, 9)), (16, 32), (16, 17, 64, 65), (64, 128),
                         long_prefix=700)
CUDA_QUICK = KernelMatrix(("fp16", "bf16"), tuple(range(1, 9)), (16, 32), (16, 17, 64, 65), (64, 128),
                          cover="pairwise", long_prefix=700)
# In the interpreter (a CPU): the same dimensions in small shapes.
CPU_FULL = KernelMatrix(("fp16", "bf16"), (1, 2, 3, 4, 8), (16, 32), (5, 17), (16, 32))
CPU_QUICK = KernelMatrix(("fp16", "bf16"), (1, 3, 8), (16, 32), (5, 17), (16, 32), cover="pairwise")


def kernel_matrix(device_type: str, quick: bool) -> KernelMatrix:
    """The case matrix for ``device_type`` ("cuda" or "cpu"), reduced with ``quick``."""
    if device_type == "cuda":
        return CUDA_QUICK if quick else CUDA_FULL
    return CPU_QUICK if quick else CPU_FULL


@dataclass(frozen=True, slots=True)
class KernelCase:
    """One launch: dtype, query heads per KV head, block size, query run, head dim,
    and the prefix of the tree request (long ones make the launch consider split-KV)."""

    dtype: str
    group: int
    block_size: int
    query_len: int
    head_dim: int
    tree_prefix: int
    seed: int = 0

    @property
    def label(self) -> str:
        """A short name, e.g. ``bf16 G3 bs16 n17 D64 p21``."""
        return (f"{self.dtype} G{self.group} bs{self.block_size} n{self.query_len} D{self.head_dim} "
                f"p{self.tree_prefix}")


def kernel_cases(matrix: KernelMatrix, seed: int = 0) -> list[KernelCase]:
    """The cases of ``matrix``: about half of them (alternating over every dimension)
    with the long prefix, when the matrix has one."""
    dims = (matrix.dtypes, matrix.groups, matrix.block_sizes, matrix.query_lens, matrix.head_dims)
    combos = list(itertools.product(*dims)) if matrix.cover == "all" else pairwise(*dims)
    cases = []
    for i, (dtype, group, block_size, query_len, head_dim) in enumerate(combos):
        long = matrix.long_prefix > 0 and (group + query_len + head_dim // 64 + block_size // 16) % 2 == 1
        prefix = matrix.long_prefix if long else block_size + 5  # ragged: crosses one block boundary
        cases.append(KernelCase(dtype, group, block_size, query_len, head_dim, prefix, seed + i))
    return cases


@dataclass(slots=True)
class KernelStep:
    """A case's inputs: a random cache, the three requests' layout and its plan."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    tree_parents: list[list[int] | None]
    num_blocks: int
    scale: float


def rooted_tree(num_tokens: int, rng: random.Random) -> list[int]:
    """Parents of a random tree of ``num_tokens`` tokens under one root (token 0)."""
    return [-1] + [rng.randrange(0, j) for j in range(1, num_tokens)]


def build_step(case: KernelCase, device: torch.device) -> KernelStep:
    """The case's random inputs on ``device``: a tree, a causal run and a decode."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    bs, n = case.block_size, case.query_len
    requests = [(n, case.tree_prefix, rooted_tree(n, rng)), (n, 3, None), (1, 2 * bs + 1, None)]
    num_blocks = sum(-(-(prefix + new) // bs) for new, prefix, _ in requests) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous block tables
    qsl, ctx, tables, parents = [0], [], [], []
    for new, prefix, tree in requests:
        tables.append([free.pop() for _ in range(-(-(prefix + new) // bs))])
        ctx.append(prefix + new)
        qsl.append(qsl[-1] + new)
        parents.append(tree)
    dtype = DTYPES[case.dtype]
    shape = (num_blocks, bs, NUM_KV_HEADS, case.head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    value_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    query = torch.randn(qsl[-1], NUM_KV_HEADS * case.group, case.head_dim, generator=gen).to(dtype).to(device)
    return KernelStep(query, key_cache, value_cache, qsl, ctx, tables, parents, num_blocks,
                      case.head_dim ** -0.5)


def kernel_plan(step: KernelStep, device: torch.device):
    """The kernels' plan of ``step`` (the new tokens' slots are never written here)."""
    from pagedtree.kernels.attention_plan import PlanBuffers, build_kernel_plan
    from pagedtree.step_data import AttentionMetadata

    bs = step.key_cache.shape[1]
    slots = []
    for table, ctx, start, end in zip(step.block_tables, step.context_lens, step.query_start_loc,
                                      step.query_start_loc[1:]):
        slots += [table[pos // bs] * bs + pos % bs for pos in range(ctx - (end - start), ctx)]
    meta = AttentionMetadata(bs, torch.tensor(slots, dtype=torch.long, device=device), step.query_start_loc,
                             step.context_lens, step.block_tables, step.tree_parents,
                             slot_bounds=(min(slots), max(slots)))
    return build_kernel_plan(meta, step.num_blocks, PlanBuffers(device))


def tolerance(case: KernelCase, value_cache: torch.Tensor) -> float:
    """The absolute tolerance of ``case``: ``2 u max|v|`` plus fp32 noise."""
    return 2 * UNIT_ROUNDOFF[case.dtype] * value_cache.float().abs().max().item() + FP32_NOISE


@dataclass(slots=True)
class KernelResult:
    """What one case gave: the largest error, its tolerance, the tile used, or the
    exception the launch raised."""

    case: KernelCase
    max_error: float = float("nan")
    tolerance: float = float("nan")
    tile: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Within tolerance, finite, and no exception."""
        return self.error is None and self.max_error <= self.tolerance

    @property
    def ratio(self) -> float:
        """Error over tolerance (inf for an exception or a non-finite output)."""
        if self.error is not None or self.max_error != self.max_error:
            return float("inf")
        return self.max_error / self.tolerance


def describe_tile(tile) -> str:
    """A tile shape as ``block_q x group_p, tile_n, splits``."""
    return f"{tile.block_q}x{tile.group_p} n{tile.tile_n} s{tile.num_splits}"


def run_case(case: KernelCase, device: torch.device) -> KernelResult:
    """Launch ``case`` with the default tile and compare with the reference."""
    from pagedtree.kernels import triton_ops

    result = KernelResult(case)
    try:
        step = build_step(case, device)
        plan = kernel_plan(step, device)
        heads = step.query.shape[1]
        tile = triton_ops.default_tile_shape(plan, heads, NUM_KV_HEADS, device, case.head_dim,
                                             step.key_cache.element_size())
        result.tile = describe_tile(tile)
        out = triton_ops.unified_attention(step.query, step.key_cache, step.value_cache, plan, step.scale)
        expected = paged_reference(step.query, step.key_cache, step.value_cache, step.query_start_loc,
                                   step.context_lens, step.block_tables, step.tree_parents, step.scale)
        diff = (out.double() - expected).abs()
        result.max_error = diff.max().item() if bool(torch.isfinite(out).all()) else float("inf")
        result.tolerance = tolerance(case, step.value_cache)
    except Exception as exc:  # noqa: BLE001 - a failing launch is a result, the other cases go on
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return result


def run_case_on(case: KernelCase, device: str) -> KernelResult:
    """:func:`run_case` with the device by name (what a worker process is sent)."""
    return run_case(case, torch.device(device))


def crashed_case(case: KernelCase, why: str) -> KernelResult:
    """The result of a case whose worker process died or hung on it."""
    return KernelResult(case, error=why)


def run_cases(cases: Sequence[KernelCase], device: torch.device, workers: int = 1,
              on_done: Callable[[KernelResult], None] | None = None, isolate: bool | None = None,
              timeout_s: float = CASE_TIMEOUT_S) -> list[KernelResult]:
    """Every case's result, in the cases' order. On CUDA (or with ``workers > 1``)
    the cases run in ``workers`` worker processes (``case_workers``): their compiles
    overlap, and a launch that crashes its process or hangs fails its own case only.
    ``on_done`` is called per case."""
    if isolate is None:
        isolate = device.type == "cuda" or workers > 1
    if not isolate:
        results = []
        for case in cases:
            results.append(run_case(case, device))
            if on_done is not None:
                on_done(results[-1])
        return results
    return run_in_workers(partial(run_case_on, device=str(device)), cases, workers, crashed_case, timeout_s,
                          on_done)


@dataclass(slots=True)
class CaseGroup:
    """The results of one row of the report: one dtype and query run."""

    dtype: str
    query_len: int
    results: list[KernelResult] = field(default_factory=list)


def summary_rows(results: Sequence[KernelResult], matrix: KernelMatrix) -> list[Row]:
    """One row per (dtype, query run): how many cases passed and the worst one."""
    groups: dict[tuple[str, int], CaseGroup] = {}
    for result in results:
        key = (result.case.dtype, result.case.query_len)
        groups.setdefault(key, CaseGroup(*key)).results.append(result)
    rows = []
    for (dtype, query_len), group in sorted(groups.items(), key=lambda kv: (kv[0][0] != "fp16", kv[0][1])):
        rows.append(_group_row(group, matrix))
    return rows


def _group_row(group: CaseGroup, matrix: KernelMatrix) -> Row:
    bad = [r for r in group.results if not r.ok]
    worst = max(group.results, key=lambda r: r.ratio)
    count = len(group.results)
    case = f"{group.dtype}, {group.query_len}-token tree + causal + decode"
    if bad:
        names = "; ".join(f"{r.case.label}: {r.error or f'err {r.max_error:.2g} > {r.tolerance:.2g}'}"
                          for r in bad[:2])
        result = f"{len(bad)}/{count} off: {names}" + (" ..." if len(bad) > 2 else "")
    else:
        result = f"{count}/{count} within 2u*max|v|"
    figure = (f"worst err/tol {worst.ratio:.2f} ({worst.case.label}, tile {worst.tile})" if worst.error is None
              else f"worst: {worst.case.label} ({worst.error[:80]})")
    detail = dict(matrix=matrix.describe(), cases=[
        dict(case=r.case.label, max_error=r.max_error, tolerance=r.tolerance, tile=r.tile, error=r.error)
        for r in group.results])
    return Row(CHECK, case, result, figure, FAIL if bad else PASS, detail)


def check_kernels(device: torch.device, quick: bool, workers: int = 1, seed: int = 0,
                  progress: Callable[[int, int], None] | None = None) -> list[Row]:
    """Check 1's rows: the case matrix for ``device`` run against the reference.
    ``progress(done, total)`` is called after every case."""
    matrix = kernel_matrix(device.type, quick)
    cases = kernel_cases(matrix, seed)
    done = [0]

    def on_done(_result: KernelResult) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], len(cases))

    results = run_cases(cases, device, workers, on_done)
    return summary_rows(results, matrix)
