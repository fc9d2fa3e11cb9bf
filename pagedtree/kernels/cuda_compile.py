"""Compile every Triton kernel for NVIDIA GPUs on a machine that has none.

Triton compiles to PTX and, with the ``ptxas`` bundled in its wheel, to cubin for any
NVIDIA target without a GPU, when the active driver reports a CUDA target and the
kernels are launched with ``warmup=True`` (they compile and are not run). This module
does that for the specialisations the launch code really produces: it calls the real
launchers of ``triton_ops`` (``store_kv``, ``unified_attention``, ``copy_rows``) with
CPU tensors shaped like a GPU step, with the kernels swapped for proxies that compile
instead of launching, so the constexprs, dtypes and integer specialisations are
exactly those a GPU run would ask for. Each compiled kernel's resource usage comes
from the cubin itself (``cuobjdump``: registers, stack frame; spill stores counted as
``STL`` instructions in the SASS).

Run it in a process of its own, without ``TRITON_INTERPRET`` (the kernels must be
defined for compilation, and the fake driver is process-wide):

    python -m pagedtree.kernels.cuda_compile --arch 80,90 --json kernels_sm.json

It exits with status 1 when a kernel fails to compile or a 16-bit kernel spills.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

# The SM count of the GPU each target stands for (tile shapes depend on it): A100,
# H100, B200 and an RTX 5090 (sm_120: consumer Blackwell, mma.sync like sm_80).
ARCH_SMS = {80: 108, 90: 132, 100: 148, 120: 170}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (64, 128)
# Query heads per KV head: Llama-3.2-3B has 3, Llama-3-8B 4, Qwen2.5-14B 5,
# Qwen2.5-1.5B 6, Qwen2.5-7B 7, Qwen2.5-32B 8.
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
BLOCK_SIZES = (16, 32)
NUM_KV_HEADS = 8
# (name, requests, new tokens per request, context length per request, tree or
# causal). The engine sends a tree of N nodes as N + 1 queries (its root first).
PHASES = {
    "decode": (32, 1, 512, False),
    "split_decode": (1, 1, 4096, False),  # too few programs for the GPU: split-KV
    "tree16": (4, 17, 1024, True),
    "tree32": (4, 33, 1024, True),
    "tree64": (4, 65, 1024, True),
    "split_tree16": (1, 17, 4096, True),  # a lone tree on a long context: split-KV with trees
    "prefill": (2, 256, 256, False),
}


# What a compile's outcome depends on besides the Triton version: the kernels, their
# launchers, the tile rules and the cases here.
SOURCES = ("triton_kernels.py", "triton_ops.py", "tiles.py", "attention_plan.py", "cuda_compile.py")
# The pairwise covering for sm_80 and sm_90 as last compiled (``--cover pairwise
# --json``), checked against the sources in the default test suite.
RECORD = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kernels_sm80_sm90.json"


def source_fingerprint(folder: Path = Path(__file__).parent) -> str:
    """A hash of everything a compile's outcome depends on: ``SOURCES`` (in
    ``folder``) and the Triton version. A record whose fingerprint differs is stale."""
    import hashlib

    import triton

    digest = hashlib.sha256(triton.__version__.encode())
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()[:16]


def case_names(arch: int, dtypes=tuple(DTYPES), head_dims=HEAD_DIMS, groups=GROUPS, block_sizes=BLOCK_SIZES,
               phases=tuple(PHASES), cover: str = "all") -> list[str]:
    """The cases ``compile_all`` launches for these values (nothing compiled)."""
    return [case for case, _, _ in _launch_cases(arch, dtypes, head_dims, groups, block_sizes, phases, cover)]


@dataclass(slots=True)
class KernelBuild:
    """One compiled specialisation and what it uses on the GPU."""

    kernel: str
    case: str  # what launched it, e.g. "bf16 D128 G4 bs16 tree64"
    arch: int  # compute capability, 80 = sm_80
    dtype: str
    num_warps: int = 0
    num_stages: int = 0
    registers: int = 0
    stack_bytes: int = 0  # per-thread stack frame: spilled registers live there
    spill_stores: int = 0  # STL instructions in the SASS
    shared_bytes: int = 0
    constexprs: dict = field(default_factory=dict)
    error: str | None = None
    # Launched to overlap the kernel before (``launch_overlap``): a global memory
    # access the PTX makes before its ``griddepcontrol.wait``, if any.
    early_access: str | None = None

    @property
    def spills(self) -> bool:
        """Whether ptxas had to spill registers to local memory."""
        return self.spill_stores > 0 or self.stack_bytes > 0


class FakeCudaDriver:
    """The part of Triton's driver interface that compiling needs: a CUDA target.

    Each capability gets its own device id, because Triton caches the target per
    device; streams do not exist (nothing is launched).
    """

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget

        self.capability = capability
        self.target = GPUTarget("cuda", capability, 32)

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.capability

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class _CompileOnly:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` compiles it."""

    def __init__(self, fn, sink: list):
        self.fn = fn
        self.sink = sink

    def __getitem__(self, grid):
        def compile_(*args, **kwargs):
            self.sink.append((self.fn, self.fn.warmup(*args, grid=grid, **kwargs), kwargs))
        return compile_


@contextlib.contextmanager
def compile_only(capability: int, overlap: bool = False) -> Iterator[list]:
    """Within: Triton targets ``sm_<capability>`` and the launchers compile instead of
    launching (``overlap``: as they launch when launches overlap, on sm_90 and
    later). Yields the list of ``(jit function, compiled kernel, constexprs)``."""
    from triton.runtime import driver

    from pagedtree.kernels import triton_kernels as K
    from pagedtree.kernels import triton_ops

    if K.INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET is set: the kernels were defined for the interpreter, not "
                           "for compilation (run this in a process without it)")
    sink: list = []
    names = [n for n in dir(K) if n.endswith("_kernel") and hasattr(getattr(K, n), "warmup")]
    saved = {n: getattr(K, n) for n in names}
    saved_check = triton_ops.check_device
    # The active driver as it was (None until first asked for): ``reset_active``
    # would build the default driver, which fails on a machine without a GPU.
    saved_driver = driver._active
    driver.set_active(FakeCudaDriver(capability))
    try:
        for n in names:
            setattr(K, n, _CompileOnly(saved[n], sink))
        triton_ops.check_device = lambda device: None  # CPU tensors stand in for CUDA ones
        with overlapping_launches(capability, overlap):
            yield sink
    finally:
        for n, fn in saved.items():
            setattr(K, n, fn)
        triton_ops.check_device = saved_check
        driver._active = saved_driver


@contextlib.contextmanager
def overlapping_launches(capability: int, overlap: bool) -> Iterator[None]:
    """Within: ``launch_overlap.active`` says what a GPU of ``capability`` would with
    launches overlapping (``overlap``) or not, for the CPU tensors that stand in for
    CUDA ones."""
    from pagedtree.kernels import launch_overlap

    saved = launch_overlap.active
    launch_overlap.active = lambda device: overlap and capability >= launch_overlap.MIN_CAPABILITY
    try:
        yield
    finally:
        launch_overlap.active = saved


def _step(block_size: int, requests: int, new: int, context: int, tree: bool):
    """Step metadata of ``requests`` requests with ``new`` new tokens each (a random
    tree, or causal) over ``context`` keys, blocks shuffled through the cache."""
    import random

    rng = random.Random(0)
    blocks_per = -(-context // block_size)
    ids = list(range(requests * blocks_per))
    rng.shuffle(ids)
    tables = [ids[i * blocks_per:(i + 1) * blocks_per] for i in range(requests)]
    slots = []
    for table in tables:
        for pos in range(context - new, context):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    parents = [[-1] + [rng.randrange(j) for j in range(1, new)] if tree else None for _ in range(requests)]
    meta = SimpleNamespace(
        block_size=block_size, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=[i * new for i in range(requests + 1)], context_lens=[context] * requests,
        block_tables=tables, tree_parents=parents, slot_bounds=(min(slots), max(slots)),
    )
    return meta, requests * blocks_per


def pairwise(*dimensions: tuple) -> list[tuple]:
    """A small set of combinations in which every pair of values of any two
    dimensions appears at least once (a greedy covering array, deterministic)."""
    everything = list(itertools.product(*dimensions))

    def pairs(combo: tuple) -> set:
        return {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(len(combo)), 2)}

    uncovered = set().union(*(pairs(c) for c in everything)) if everything else set()
    chosen = []
    while uncovered:
        best = max(everything, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def _launch_step(arch: int, dtype: torch.dtype, head_dim: int, group: int, block_size: int, requests: int,
                 new: int, context: int, tree: bool, copies: bool) -> None:
    """Run the launchers of one step as a GPU of ``sm_<arch>`` would: the KV store,
    attention with the tile shape the launch code picks there, and (``copies``) a
    copy-on-write block copy and a slot compaction."""
    from pagedtree.kernels import attention_plan as AP
    from pagedtree.kernels import triton_ops
    from pagedtree.kernels.tiles import choose_tile_shape

    meta, num_blocks = _step(block_size, requests, new, context, tree)
    plan = AP.build_kernel_plan(meta, num_blocks, AP.PlanBuffers(torch.device("cpu")))
    cache = [torch.empty(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype=dtype) for _ in range(2)]
    key = torch.empty(plan.num_tokens, NUM_KV_HEADS, head_dim, dtype=dtype)
    query = torch.empty(plan.num_tokens, NUM_KV_HEADS * group, head_dim, dtype=dtype)
    triton_ops.store_kv(key, key, cache[0], cache[1], plan.slot_mapping, slots_checked=True)
    tile = choose_tile_shape(plan.max_query_len, group, plan.num_requests, NUM_KV_HEADS, plan.max_context_len,
                             interpreted=False, num_sms=ARCH_SMS[arch], block_size=block_size, capability=arch,
                             head_dim=head_dim, kv_elem_bytes=cache[0].element_size())
    triton_ops.unified_attention(query, cache[0], cache[1], plan, 1.0 / head_dim ** 0.5, tile=tile)
    if copies:
        table = triton_ops.pointer_table(cache, torch.device("cpu"))
        row = block_size * NUM_KV_HEADS * head_dim
        triton_ops.copy_rows(cache, table, num_blocks, row, [0], [1])  # copy-on-write block
        triton_ops.copy_rows(cache, table, num_blocks * block_size, NUM_KV_HEADS * head_dim, [0, 1], [1, 2])


def _launch_cases(arch: int, dtypes, head_dims, groups, block_sizes, phases,
                  cover: str = "all") -> Iterator[tuple[str, str, callable]]:
    """``(case, dtype name, launch)`` for every combination (``cover="all"``) or a
    pairwise covering of them: ``launch()`` runs the launchers of one step (store,
    attention, block and slot copies)."""
    dims = (dtypes, head_dims, groups, block_sizes, phases)
    combos = list(itertools.product(*dims)) if cover == "all" else pairwise(*dims)
    for dname, head_dim, group, block_size, phase in combos:
        requests, new, context, tree = PHASES[phase]
        case = f"{dname} D{head_dim} G{group} bs{block_size} {phase}"

        def launch(dname=dname, head_dim=head_dim, group=group, block_size=block_size,
                   requests=requests, new=new, context=context, tree=tree):
            _launch_step(arch, DTYPES[dname], head_dim, group, block_size, requests, new, context, tree, copies=True)

        yield case, dname, launch


def varying_steps(arch: int) -> dict[str, int]:
    """Distinct compiled variants per kernel over decode and tree steps whose sizes
    change as a server's do (batch, context, block-table width): 1 each means a
    server never compiles mid-run once warmed up."""
    variants: dict[str, set] = {}
    steps = [(b, 1, ctx, False) for b, ctx in ((17, 100), (24, 517), (33, 900), (64, 260))]
    steps += [(b, 17, ctx, True) for b, ctx in ((9, 40), (12, 333), (20, 800))]
    for requests, new, context, tree in steps:
        with compile_only(arch) as sink:
            _launch_step(arch, torch.bfloat16, 128, 4, 16, requests, new, context, tree, copies=False)
        for fn, compiled, _ in sink:
            # A tree step's tile differs from decode's by design: they are counted apart.
            name = fn.__name__ + (f":{'tree' if tree else 'decode'}" if "attention" in fn.__name__ else "")
            variants.setdefault(name, set()).add(str(compiled.metadata.hash))
    return {name: len(hashes) for name, hashes in variants.items()}


def resource_usage(cubin: bytes, tools: Path) -> dict[str, int]:
    """Registers, stack frame and spill stores of the cubin's kernel (``cuobjdump``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", path],
                               check=True, capture_output=True, text=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", path],
                              check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    return {"registers": found.get("REG", 0), "stack_bytes": max(found.get("STACK", 0), found.get("LOCAL", 0)),
            "spill_stores": len(re.findall(r"\bSTL(?:\.\w+)*\b", sass))}


# PTX instructions that touch global memory (an L2 prefetch does not count: it
# reads what no kernel writes, and the products issue it on purpose before waiting).
_GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?"
                            r"(?:ld\.global|st\.global|atom\.|red\.|cp\.async|ld\.volatile\.global)")


def early_access(ptx: str) -> str | None:
    """The first global memory access a kernel launched to overlap its predecessor
    makes before its ``griddepcontrol.wait`` (None: none, or no wait at all)."""
    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    if wait is None:
        return None
    early = next((line.strip() for line in lines[:wait] if _GLOBAL_ACCESS.match(line)), None)
    return f"accesses global memory before its wait: {early}" if early else None


def make_build(fn, compiled, kwargs: dict, case: str, arch: int, dname: str, tools: Path) -> KernelBuild:
    """The ``KernelBuild`` of one compiled specialisation: its launch, resources and
    (launched to overlap) whether it waits before touching memory."""
    constexprs = {k: (str(v) if not isinstance(v, (int, float, bool)) else v) for k, v in kwargs.items()}
    build = KernelBuild(fn.__name__, case, arch, dname, num_warps=compiled.metadata.num_warps,
                        num_stages=compiled.metadata.num_stages, shared_bytes=compiled.metadata.shared,
                        constexprs=constexprs, early_access=early_access(compiled.asm["ptx"]))
    try:
        for k, v in resource_usage(compiled.asm["cubin"], tools).items():
            setattr(build, k, v)
    except (OSError, subprocess.CalledProcessError) as exc:
        build.error = f"cuobjdump: {exc}"
    return build


def _tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_all(arch: int, dtypes=tuple(DTYPES), head_dims=HEAD_DIMS, groups=GROUPS, block_sizes=BLOCK_SIZES,
                phases=tuple(PHASES), progress: bool = False, cover: str = "all",
                overlap: bool = False) -> list[KernelBuild]:
    """Every kernel specialisation of the given cases compiled for ``sm_<arch>``, one
    entry per distinct specialisation (the first case that produced it); ``overlap``:
    as launched when launches overlap."""
    tools = _tools()
    builds: list[KernelBuild] = []
    seen: set[tuple] = set()
    cases = list(_launch_cases(arch, dtypes, head_dims, groups, block_sizes, phases, cover))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cases), desc=f"sm_{arch}", unit="case", file=sys.stderr)
    for case, dname, launch in cases:
        with compile_only(arch, overlap) as sink:
            try:
                launch()
            except Exception as exc:  # noqa: BLE001 - recorded; the other cases go on
                builds.append(KernelBuild("?", case, arch, dname, error=f"{type(exc).__name__}: {exc}"))
        for fn, compiled, kwargs in sink:
            key = (fn.__name__, tuple(sorted((k, str(v)) for k, v in kwargs.items())), str(compiled.metadata.hash))
            if key in seen:
                continue
            seen.add(key)
            builds.append(make_build(fn, compiled, kwargs, case, arch, dname, tools))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return builds


def problems(builds: list[KernelBuild]) -> list[str]:
    """Compile errors, and register spills in kernels that run on 16-bit data."""
    out = []
    for b in builds:
        if b.error:
            out.append(f"sm_{b.arch} {b.kernel} ({b.case}): {b.error}")
        elif b.spills and b.dtype in ("fp16", "bf16"):
            out.append(f"sm_{b.arch} {b.kernel} ({b.case}): spills ({b.spill_stores} spill stores, "
                       f"{b.stack_bytes} bytes of stack, {b.registers} registers)")
        if b.early_access:
            out.append(f"sm_{b.arch} {b.kernel} ({b.case}): {b.early_access}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--groups", default=",".join(map(str, GROUPS)), help="query heads per KV head")
    parser.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    parser.add_argument("--phases", default=",".join(PHASES), help=f"of {', '.join(PHASES)}")
    parser.add_argument("--cover", choices=["all", "pairwise"], default="all",
                        help="every combination of the values above, or a pairwise covering of them (every "
                             "pair of values of two dimensions at least once: about a tenth of the compiles)")
    parser.add_argument("--json", default=None, help="write every build's resource usage here")
    parser.add_argument("--overlap", action="store_true",
                        help="compile the launches as they are when launches overlap (PAGEDTREE_PDL=1; sm_90 and "
                             "later), each checked to wait before it touches memory")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    strs = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    for phase in strs(args.phases):
        if phase not in PHASES:
            parser.error(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
    for dname in strs(args.dtypes):
        if dname not in DTYPES:
            parser.error(f"unknown dtype {dname!r}; known: {', '.join(DTYPES)}")
    started = time.perf_counter()
    builds: list[KernelBuild] = []
    for arch in ints(args.arch):
        if arch not in ARCH_SMS:
            parser.error(f"unsupported arch {arch}; known: {', '.join(map(str, ARCH_SMS))}")
        builds += compile_all(arch, strs(args.dtypes), ints(args.head_dims), ints(args.groups),
                              ints(args.block_sizes), strs(args.phases), progress=not args.no_progress,
                              cover=args.cover, overlap=args.overlap)
    stable = {arch: varying_steps(arch) for arch in ints(args.arch)}
    import triton

    values = (strs(args.dtypes), ints(args.head_dims), ints(args.groups), ints(args.block_sizes), strs(args.phases))
    report = {"triton": triton.__version__, "torch": torch.__version__, "seconds": time.perf_counter() - started,
              "fingerprint": source_fingerprint(), "cover": args.cover,
              "cases": {arch: case_names(arch, *values, cover=args.cover) for arch in ints(args.arch)},
              "builds": [asdict(b) | {"spills": b.spills} for b in builds],
              "variants_over_varying_steps": stable}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    bad = problems(builds)
    for arch, counts in stable.items():
        bad += [f"sm_{arch} {name}: {n} variants over steps of varying sizes (a server would recompile)"
                for name, n in counts.items() if n != 1]
    print(f"{len(builds)} kernel specialisations compiled for sm_{'/sm_'.join(args.arch.split(','))} "
          f"in {report['seconds']:.0f} s; {len(bad)} problems")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
