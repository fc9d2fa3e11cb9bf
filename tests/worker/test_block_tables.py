"""Block tables of static (CUDA-graph) steps: kept on the device between steps, only
what changed sent up.

Checked on a CPU: after every step the device rows equal the requests' real tables
on their real lengths (while tables grow, a block is swapped by copy-on-write, rows
change owner, the batch shrinks and grows), entries past them stay valid block ids,
attention through the padded static steps gives the eager logits, and the host work
of a step does not depend on ``max_model_len``.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedtree import SamplingParams
from pagedtree.kernels.attention_plan import PlanBuffers, build_kernel_plan
from pagedtree.kernels.block_tables import DeviceBlockTables
from pagedtree.step_data import StaticShape
from pagedtree.loading.loader import load_model
from pagedtree.request import Request
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.step_data import AttentionMetadata, Phase, ScheduledChunk
from pagedtree.uploads import StagedUpload
from pagedtree.worker.model_runner import ModelRunner
from pagedtree.worker.step_inputs import host_step
from tests.loadgen.conftest import load_benchmark

CPU = torch.device("cpu")


def _check_rows(tables: DeviceBlockTables, real: list[list[int]], num_blocks: int) -> None:
    """Every row equals its real table on the table's length; every entry is a valid id."""
    for i, table in enumerate(real):
        assert tables.table[i, :len(table)].tolist() == table, f"row {i}"
    assert int(tables.table.min()) >= 0 and int(tables.table.max()) < num_blocks


def test_a_step_sends_only_what_changed():
    tables = DeviceBlockTables(rows=8, width=300, device=CPU)
    a, b, c = list(range(10, 15)), list(range(100, 300)), [7, 8, 9]
    tables.update([a, b, c], ["a", "b", "c"], num_blocks=1000)
    _check_rows(tables, [a, b, c], 1000)
    assert tables.last_upload == 2 * (5 + 200 + 3)  # values and their positions
    tables.update([a, b, c], ["a", "b", "c"], num_blocks=1000)
    assert tables.last_upload == 0  # nothing changed: nothing sent
    b.append(500)  # a new block
    tables.update([a, b, c], ["a", "b", "c"], num_blocks=1000)
    assert tables.last_upload == 2
    b[150] = 600  # copy-on-write swapped one block in the middle
    tables.update([a, b, c], ["a", "b", "c"], num_blocks=1000)
    _check_rows(tables, [a, b, c], 1000)
    assert tables.last_upload == 2 * DeviceBlockTables.CHUNK  # its chunk only
    del b[-3:]  # rejected branches' blocks freed: the table shrinks, nothing to send
    tables.update([a, b, c], ["a", "b", "c"], num_blocks=1000)
    assert tables.last_upload == 0
    tables.update([b, c], ["b", "c"], num_blocks=1000)  # "a" ended: the batch moved up
    _check_rows(tables, [b, c], 1000)
    assert tables.last_upload == 2 * 2  # two row moves on the device, no entry re-sent
    d = [1, 2, 3, 4]
    tables.update([b, c, d], ["b", "c", "d"], num_blocks=1000)  # a new request in row 2
    _check_rows(tables, [b, c, d], 1000)
    assert tables.last_upload <= 2 * len(d)


def test_a_bad_block_id_is_refused_and_nothing_changes():
    tables = DeviceBlockTables(rows=2, width=10, device=CPU)
    tables.update([[1, 2], [3]], ["a", "b"], num_blocks=50)
    before = tables.table.clone()
    with pytest.raises(ValueError, match="outside"):
        tables.update([[1, 2, 50], [3]], ["a", "b"], num_blocks=50)
    with pytest.raises(ValueError, match="wider"):
        tables.update([[1] * 11, [3]], ["a", "b"], num_blocks=50)
    assert torch.equal(tables.table, before) and tables.held(0) == [1, 2]
    tables.update([[1, 2, 4], [3]], ["a", "b"], num_blocks=50)
    _check_rows(tables, [[1, 2, 4], [3]], 50)


@pytest.mark.parametrize("with_keys", [True, False])
def test_random_tables_match_on_the_device_every_step(with_keys):
    """Tables that grow, shrink, swap blocks, are rebuilt (a recompute), end, join,
    move rows, and share keys (a draft's forked sequences share their request's)."""
    rng = random.Random(7)
    num_blocks, width = 5000, 120
    tables = DeviceBlockTables(rows=16, width=width, device=CPU)
    live: dict[str, list[int]] = {}
    serial = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.15 and len(live) < 16:
            serial += 1
            live[f"r{serial}"] = [rng.randrange(num_blocks) for _ in range(rng.randrange(1, width))]
        elif op < 0.25 and live:
            live.pop(rng.choice(list(live)))
        elif op < 0.35 and live:
            live[rng.choice(list(live))] = [rng.randrange(num_blocks) for _ in range(rng.randrange(1, width))]
        for table in live.values():
            r = rng.random()
            if r < 0.3 and len(table) < width:
                table.append(rng.randrange(num_blocks))
            elif r < 0.4:
                table[rng.randrange(len(table))] = rng.randrange(num_blocks)
            elif r < 0.5 and len(table) > 1:
                del table[rng.randrange(1, len(table)):]
        order = list(live)
        if rng.random() < 0.2:
            rng.shuffle(order)
        real = [live[k] for k in order]
        keys = [k if rng.random() < 0.9 else "shared" for k in order] if with_keys else None
        view = tables.update(real, keys, num_blocks)
        assert view.shape == (len(real), width)
        _check_rows(tables, real, num_blocks)


# --------------------------------------------------------------------- a model
BLOCK = 4
BLOCKS = 64


@pytest.fixture
def runner(tiny_llama):
    loaded = load_model(tiny_llama.path)
    runner = ModelRunner(loaded.model, BLOCKS, BLOCK, CPU, torch.float32, "triton")
    gen = torch.Generator().manual_seed(0)
    for key_cache, value_cache in runner.kv_caches:  # every context's keys and values
        key_cache[:BLOCKS].normal_(generator=gen)
        value_cache[:BLOCKS].normal_(generator=gen)
    return runner


class _Requests:
    """Requests decoding one token per step in a block manager."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.bm = BlockManager(BLOCKS, BLOCK, enable_prefix_caching=False)
        self.requests: dict[str, Request] = {}
        self.lengths: dict[str, int] = {}

    def add(self, rid: str, length: int) -> None:
        tokens = [(7 * length + i) % 200 for i in range(length)]
        self.requests[rid] = Request(rid, None, tokens, SamplingParams(temperature=0), sampling_seed=0)
        self.bm.allocate(rid, tokens)
        self.lengths[rid] = length

    def fork(self, parent: str, child: str) -> None:
        """``child`` shares ``parent``'s blocks; its next token copies the shared last block."""
        self.bm.fork(parent, child)
        self.requests[child] = Request(child, None, list(self.requests[parent].prompt_token_ids),
                                       SamplingParams(temperature=0), sampling_seed=0)
        self.lengths[child] = self.lengths[parent]

    def end(self, rid: str) -> None:
        self.bm.free(rid)
        del self.requests[rid], self.lengths[rid]

    def step(self, order: list[str]) -> list[ScheduledChunk]:
        """One more token for each of ``order`` (copy-on-write copies applied)."""
        chunks = []
        for rid in order:
            n = self.lengths[rid] = self.lengths[rid] + 1
            copies = self.bm.append_slots(rid, 1)
            self.runner.copy_blocks([c.src for c in copies], [c.dst for c in copies])
            chunks.append(ScheduledChunk(self.requests[rid], Phase.DECODE, [(3 * n) % 200], [n - 1],
                                         self.bm.slots(rid, n - 1, n), self.bm.block_table(rid), n, 0))
        return chunks


def test_static_steps_follow_every_table_change_and_give_the_eager_logits(runner):
    runner.enable_cuda_graphs(max_num_seqs=8, max_model_len=64, max_tree_tokens=1, capture=False)
    graphs, reqs = runner.graphs, _Requests(runner)
    for rid, length in (("a", 5), ("b", 8), ("c", 3)):
        reqs.add(rid, length)
    plans = [
        ["a", "b", "c"],  # b's table grows by a block
        "fork b b2", ["a", "b2", "b", "c"],  # b2 copies b's shared, part-filled last block
        "end a", ["b2", "b", "c"],  # the batch moves up a row
        ["b", "c"],  # shrinks to a bucket of 2
        "add d 13", "add e 2", ["b", "c", "d", "e", "b2"],  # grows to 8: new owners of rows 2-4
    ]
    swapped = False
    tables = runner.attention._buffers.block_tables(8, graphs.max_blocks)
    for plan in plans:
        if isinstance(plan, str):
            op, *args = plan.split()
            {"fork": reqs.fork, "end": reqs.end, "add": lambda rid, n: reqs.add(rid, int(n))}[op](*args)
            continue
        chunks = reqs.step(plan)
        rows = list(range(len(chunks)))
        eager = runner.run_step(host_step(chunks, rows))
        shape = graphs.shape_for(chunks)
        static = graphs.forward(chunks, rows, shape)
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
        real = [chunk.block_table for chunk in chunks]
        _check_rows(tables, real, BLOCKS + 1)  # the scratch block past the manager's
        assert runner.attention._plan.block_tables.data_ptr() == tables.table.data_ptr()
        swapped |= "b2" in plan and real[plan.index("b2")][-1] != real[plan.index("b")][-1]
    assert swapped and graphs.num_steps == sum(isinstance(p, list) for p in plans)


def _uploaded_per_step(runner: ModelRunner, max_model_len: int, monkeypatch) -> list[int]:
    """int32/int64 elements sent to the device by each of a few static decode steps."""
    runner.enable_cuda_graphs(max_num_seqs=8, max_model_len=max_model_len, max_tree_tokens=1, capture=False)
    sent: list[int] = []
    call = StagedUpload.__call__

    def counting(self, values):
        sent.append(values.numel())
        return call(self, values)

    monkeypatch.setattr(StagedUpload, "__call__", counting)
    reqs, per_step = _Requests(runner), []
    for rid, length in (("a", 5), ("b", 9), ("c", 3)):
        reqs.add(rid, length)
    for order in (["a", "b", "c"], ["a", "b", "c"], ["b", "c"], ["b", "c", "a"]):
        sent.clear()
        chunks = reqs.step(order)
        runner.graphs.prepare(chunks, list(range(len(chunks))), runner.graphs.shape_for(chunks))
        per_step.append(sum(sent))
    monkeypatch.setattr(StagedUpload, "__call__", call)
    return per_step


def test_host_work_of_a_static_step_does_not_grow_with_max_model_len(runner, monkeypatch):
    """What a static step builds on the host and sends is the same at 4k and 128k
    positions (before, the tables went up padded to the full width every step)."""
    short = _uploaded_per_step(runner, 4096, monkeypatch)
    long = _uploaded_per_step(runner, 131072, monkeypatch)
    assert short == long
    assert max(short) < 200  # a few dozen inputs and plan entries, whatever the width


@pytest.mark.slow
def test_plan_build_time_does_not_grow_with_max_model_len():
    # The benchmark's own measurement (benchmarks/static_plan.py), at a 1k context.
    plan_ms = load_benchmark("static_plan").plan_ms
    short, long = plan_ms(4096, 32, 1024, steps=30), plan_ms(131072, 32, 1024, steps=30)
    assert long < 2 * short + 0.05, (short, long)
