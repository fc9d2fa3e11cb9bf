"""Whole drafts (``DraftWorker.whole_drafts``, what a GPU does): every node's slot
reserved first, every level queued on the worker with its input tokens taken from the
children drawn on the device, every level read back at once. They propose the same
trees, give the same tokens and acceptance as drafting level by level, and leave no
KV block behind: chains and static trees (greedy, seeded and unseeded requests), in
eager steps and in the padded static steps CUDA graphs replay."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from pagedtree.speculative.drafting.proposer import TreeProposer
from tests.conftest import assert_no_leaks, random_prompts

CHAIN = SpeculativeConfig(tree="chain", depth=4, max_nodes=4, adaptive=False)
TREE = SpeculativeConfig(tree="static", expansion=(3, 2, 1), max_nodes=16, adaptive=False)


def _run(model, draft, whole: bool, params, prompts, static: bool = False, draft_graphs: bool = True,
         capture: bool = False, **kwargs):
    """Outputs, stats (with ``whole_draft_programs``: the drafts run as one static
    program), the jobs of each whole draft, and every proposed tree."""
    llm = LLM(str(model.path), dtype="float32", device="cpu", block_size=4, max_num_seqs=4, seed=3,
              draft_model=[str(draft.path)], speculative=kwargs.pop("speculative", CHAIN), **kwargs)
    engine = llm.engine
    worker = engine.speculation.drafts[0]
    worker.whole_drafts = whole
    if static:
        from pagedtree.executor.shards import DRAFT_GRAPH_TOKENS

        engine.runner.enable_cuda_graphs(4, engine.max_model_len, 17, capture=False)
        worker.runner.enable_cuda_graphs(16, engine.max_model_len, DRAFT_GRAPH_TOKENS, capture=False)
        if not draft_graphs:
            worker.runner.graphs.drafts = None  # each level through its padded step
        elif capture:
            worker.runner.graphs.drafts.capture = True  # (with CUDA's capture played by _FakeCapture)
    whole_jobs, trees = [], []
    drafted_whole = type(worker)._propose_whole

    def counted(self, jobs):
        branching = [any(len(job.builder.shape_children(n)) > 1 for n in [-1, *range(len(job.builder.shape.parents))])
                     for job in jobs]
        whole_jobs.append([(job.builder.rule, b) for job, b in zip(jobs, branching)])
        return drafted_whole(self, jobs)

    worker._propose_whole = counted.__get__(worker)
    proposer = engine.speculation.proposer
    propose = TreeProposer.propose

    def recorded(requests_and_budgets):
        found = propose(proposer, requests_and_budgets)
        trees.append(sorted((rid, tuple(t.tokens), tuple(t.parents)) for rid, t in found.items()))
        return found

    proposer.propose = recorded
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    graphs = worker.runner.graphs
    stats["whole_draft_programs"] = graphs.drafts.num_drafts if graphs is not None and graphs.drafts else 0
    if graphs is not None and graphs.drafts:  # the graphs the draft shapes hold, a part each
        entries = graphs.drafts._entries.values()
        stats["draft_graphs"] = sum(len(entry.graphs) for entry in entries)
        stats["draft_parts"] = sum(len(entry.parts) for entry in entries)
    worker.block_manager.check_invariants()
    assert_no_leaks(llm)
    return [[c.token_ids for c in o.outputs] for o in outs], stats, whole_jobs, trees


@pytest.fixture
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(3, 256, 3, 8, seed=11)]


def _same(got, want):
    (got_outs, got_stats, _, got_trees), (want_outs, want_stats, _, want_trees) = got, want
    assert got_outs == want_outs
    assert got_trees == want_trees
    for key in ("num_draft_tokens", "num_accepted_tokens", "num_target_forward_passes"):
        assert got_stats[key] == want_stats[key], key
    assert got_stats["num_draft_tokens"] > 0


def test_whole_chains_draft_what_level_by_level_drafts(tiny_llama, tiny_llama_draft, prompts):
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)]
    want = _run(tiny_llama, tiny_llama_draft, False, params, prompts)
    got = _run(tiny_llama, tiny_llama_draft, True, params, prompts)
    assert want[2] == [] and got[2]  # the whole path ran, and only where asked
    _same(got, want)


def test_whole_trees_draft_what_level_by_level_drafts(tiny_llama, tiny_llama_draft, prompts):
    """A static tree of 3 x 2 x 1 below the root: forks, copy-on-write copies of
    shared partial blocks (4-token blocks), the same trees and acceptance."""
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    want = _run(tiny_llama, tiny_llama_draft, False, params, prompts, speculative=TREE)
    got = _run(tiny_llama, tiny_llama_draft, True, params, prompts, speculative=TREE)
    assert got[2]
    _same(got, want)


def test_whole_trees_when_blocks_run_short(tiny_llama, tiny_llama_draft, prompts):
    """A draft cache too small for every node: the nodes without a block stay
    leaves, as level by level, and every block comes back."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kwargs = dict(speculative=TREE, num_draft_kv_blocks=12)
    want = _run(tiny_llama, tiny_llama_draft, False, params, prompts, **kwargs)
    got = _run(tiny_llama, tiny_llama_draft, True, params, prompts, **kwargs)
    assert got[0] == want[0] and got[2]


@pytest.mark.triton_interpreter
def test_whole_drafts_through_padded_static_steps(tiny_llama, tiny_llama_draft, prompts):
    """The fed tokens reach the static input buffers of the draft's padded steps."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = _run(tiny_llama, tiny_llama_draft, False, params, prompts[:2], attention_backend="triton",
                speculative=TREE)
    got = _run(tiny_llama, tiny_llama_draft, True, params, prompts[:2], static=True, attention_backend="triton",
               speculative=TREE)
    # Verification keeps the tokens exact whatever is drafted: the drafts' acceptance
    # shows the fed tokens were the drawn ones.
    assert got[0] == want[0] and got[2] and got[1]["num_draft_tokens"] > 0
    assert got[1]["num_accepted_tokens"] == want[1]["num_accepted_tokens"] > 0


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("speculative", [CHAIN, TREE], ids=["chain", "tree"])
def test_a_whole_draft_as_one_static_program_drafts_what_its_padded_levels_draft(tiny_llama, tiny_llama_draft,
                                                                                prompts, speculative, monkeypatch):
    """One program for the whole draft (``draft_graphs.py``: a CUDA graph on a GPU):
    the same trees, tokens and acceptance as each level through its own padded
    step, greedy and seeded (coupled) requests, forks' copy-on-write copies included,
    and every block back."""
    tokens = 16 if speculative is TREE else 8  # (a tree's budget needs room left to branch below the root)
    params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=tokens, ignore_eos=True)]
    kwargs = dict(static=True, attention_backend="triton", speculative=speculative)
    want = _run(tiny_llama, tiny_llama_draft, True, params, prompts[:2], draft_graphs=False, **kwargs)
    from pagedtree.attention.triton_backend import TritonPagedAttention

    in_program = []
    copy = TritonPagedAttention.copy_blocks_on_device
    monkeypatch.setattr(TritonPagedAttention, "copy_blocks_on_device",
                        lambda self, src, dst: (in_program.append(src.numel()), copy(self, src, dst)))
    got = _run(tiny_llama, tiny_llama_draft, True, params, prompts[:2], **kwargs)
    assert want[1]["whole_draft_programs"] == 0
    assert (sum(in_program) > 0) == (speculative is TREE)  # forks below the root copy in the program
    # Every draft after each request's first (its prompt is too long a catch-up for a
    # padded step) ran as one program.
    assert got[1]["whole_draft_programs"] >= len(got[2]) - 1 > 0
    _same(got, want)


class _FakeCapture:
    """CUDA's graph capture played on a CPU: a graph records the program called inside
    its capture without running it (a capture launches nothing) and replays it by
    running it, over whatever the static buffers hold then, as a replay reads them."""

    def __init__(self, monkeypatch, fail: bool = False):
        from pagedtree.worker.cuda_graphs import StepGraphs
        from pagedtree.worker.draft_graphs import DraftGraphs

        self.captures = self.replays = 0
        self.events: list[tuple] = []  # of the draft being queued: its fills and replays, in order
        recording = []
        fake = self

        class Graph:
            program = None

            def replay(self):
                fake.replays += 1
                fake.events.append(("replay",))
                self.program()

            def pool(self):
                return "pool"

        class Capture:
            def __init__(self, graph, pool=None):
                self.graph = graph

            def __enter__(self):
                if fail:
                    raise RuntimeError("operation not permitted when stream is capturing")
                recording.append(self.graph)

            def __exit__(self, *exc):
                recording.clear()
                fake.captures += 1

        class Stream:
            def wait_stream(self, other):
                pass

        program = DraftGraphs._program
        queue = DraftGraphs.queue
        self.parts: list[int] = []  # per draft run through the draft graphs, its parts

        def recorded(graphs, entry, start, stop):
            if recording:
                recording[0].program = lambda: program(graphs, entry, start, stop)
                return None
            return program(graphs, entry, start, stop)

        prepare = DraftGraphs._prepare
        self.late_fills = 0  # drafts whose later levels were filled after the first level's replay

        def filled(graphs, entry, levels, start, stop):
            self.events.append(("fill", start))
            return prepare(graphs, entry, levels, start, stop)

        def queued(graphs, levels):
            self.events = []
            children = queue(graphs, levels)
            if children is not None:
                fake.parts.append(len(graphs._entries[graphs.key_for(levels)].parts))
                if fake.parts[-1] == 2 and self.events.index(("fill", 1)) > self.events.index(("replay",)):
                    self.late_fills += 1
            return children

        monkeypatch.setattr(DraftGraphs, "_program", recorded)
        monkeypatch.setattr(DraftGraphs, "_prepare", filled)
        monkeypatch.setattr(DraftGraphs, "queue", queued)
        monkeypatch.setattr(StepGraphs, "side_stream", lambda self: Stream())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)


@pytest.mark.triton_interpreter
def test_whole_draft_graphs_capture_once_and_replay(tiny_llama, tiny_llama_draft, prompts, monkeypatch, caplog):
    """The capture path (CUDA's capture played on a CPU by ``_FakeCapture``): a draft
    shape is captured the first time it runs and replayed after, with the same trees,
    tokens and acceptance as each level through its padded step; a shape whose
    capture fails drafts level by level from then on, with a warning, all the same.
    (Both against one run of each level through its padded step.)"""
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)]
    kwargs = dict(static=True, attention_backend="triton", speculative=CHAIN)
    want = _run(tiny_llama, tiny_llama_draft, True, params, prompts[:2], draft_graphs=False, **kwargs)
    fake = _FakeCapture(monkeypatch)
    got = _run(tiny_llama, tiny_llama_draft, True, params, prompts[:2], capture=True, **kwargs)
    _same(got, want)
    # Each shape's parts (the first level; the levels after it) captured once each.
    assert 0 < fake.captures == got[1]["draft_graphs"] == got[1]["draft_parts"]
    # Every draft replays every part of its shape; shapes repeat: replays without a capture.
    assert fake.replays == sum(fake.parts) and len(fake.parts) == got[1]["whole_draft_programs"]
    assert fake.replays > fake.captures and max(fake.parts) == 2
    # The later levels are filled after the first level's graph is launched (on a GPU:
    # while it runs), in every draft of two parts.
    assert fake.late_fills == fake.parts.count(2) > 0
    assert "capture failed for a draft" not in caplog.text
    fake = _FakeCapture(monkeypatch, fail=True)
    got = _run(tiny_llama, tiny_llama_draft, True, params, prompts[:2], capture=True, **kwargs)
    _same(got, want)
    assert fake.captures == fake.replays == got[1]["whole_draft_programs"] == 0
    assert "capture failed for a draft" in caplog.text


def test_unseeded_trees_draft_what_level_by_level_drafts(tiny_llama, tiny_llama_draft, prompts):
    """Unseeded sampling in a tree, children drawn without replacement from the whole
    distribution (nothing the rule could not draw, nothing repeated): the same
    draws along each request's random stream, so the same trees and tokens."""
    params = SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True)
    want = _run(tiny_llama, tiny_llama_draft, False, params, prompts, speculative=TREE)
    got = _run(tiny_llama, tiny_llama_draft, True, params, prompts, speculative=TREE)
    assert any(branching for jobs in got[2] for _, branching in jobs)
    _same(got, want)


def test_iid_trees_draft_whole(tiny_llama, tiny_llama_draft, prompts):
    """I.i.d. children repeat tokens: the repeats are fed and drawn below all the
    same, then dropped with their KV (their distribution: test_distribution.py)."""
    params = SamplingParams(temperature=1.2, max_tokens=10, ignore_eos=True)
    tree = SpeculativeConfig(tree="static", expansion=(3, 2, 1), max_nodes=16, adaptive=False, draft_sampling="iid")
    got = _run(tiny_llama, tiny_llama_draft, True, params, prompts, speculative=tree)
    assert any(rule == "iid" and branching for jobs in got[2] for rule, branching in jobs)
    assert got[1]["num_draft_tokens"] > 0 and all(len(o[0]) == 10 for o in got[0])
