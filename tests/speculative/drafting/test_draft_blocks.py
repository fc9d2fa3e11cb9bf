"""Block bookkeeping of token-tree branches, driven through the real DraftWorker.

A stub runner stands in for the draft model: it returns random logits and checks,
at every forward, that each slot written belongs to a block no other sequence holds
(copy-on-write must have happened first).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedtree.request import Request
from pagedtree.sampling_params import SamplingParams
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.speculative.drafting.builders import DynamicTreeBuilder, ShapeTreeBuilder
from pagedtree.speculative.tree import TreeShape
from pagedtree.speculative.drafting.draft_worker import DraftJob, DraftWorker

VOCAB = 12


class StubRunner:
    """Just enough of ModelRunner for the draft worker, with a COW check."""

    def __init__(self, block_manager: BlockManager, seed: int):
        self.bm = block_manager
        self.gen = torch.Generator().manual_seed(seed)
        self.copied: list[tuple[int, int]] = []

    def copy_blocks(self, src, dst):
        self.copied.extend(zip(src, dst))

    def forward(self, chunks, logit_rows):
        bs = self.bm.block_size
        for chunk in chunks:
            for slot in chunk.slot_mapping:
                block = slot // bs
                assert self.bm.ref_count(block) == 1, f"write into shared block {block}"
                assert block in chunk.block_table
        return torch.randn(len(logit_rows), VOCAB, generator=self.gen) * 3

    def generator_for(self, request_id, seed):
        return torch.Generator().manual_seed(seed)

    def release(self, request_ids):
        pass


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_requests = draw(st.integers(1, 3))
    requests = []
    for i in range(num_requests):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        kind = draw(st.sampled_from(["static", "dynamic"]))
        expansion = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
        budget = draw(st.integers(1, 12))
        rounds = draw(st.lists(st.integers(0, 6), min_size=1, max_size=3))  # accepted length per round
        requests.append((prompt, kind, expansion, budget, rounds))
    seed = draw(st.integers(0, 1000))
    return block_size, requests, seed


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_tree_branches_never_leak_and_rejected_blocks_free_at_once(scenario):
    block_size, specs, seed = scenario
    bm = BlockManager(400, block_size, enable_prefix_caching=True)
    worker = DraftWorker(StubRunner(bm, seed), bm)  # type: ignore[arg-type]
    requests = [
        Request(str(i), None, list(prompt), SamplingParams(temperature=0), sampling_seed=i)
        for i, (prompt, *_rest) in enumerate(specs)
    ]
    for r in requests:
        r.output_token_ids.append(1)  # the root: the target's newest token
    num_rounds = max(len(s[4]) for s in specs)
    for round_index in range(num_rounds):
        jobs = []
        for r, (_, kind, expansion, budget, rounds) in zip(requests, specs):
            if round_index >= len(rounds):
                continue
            root = r.output_token_ids[-1]
            if kind == "static":
                builder = ShapeTreeBuilder(TreeShape.from_expansion(expansion, budget), root, r.params, "topk", None)
            else:
                builder = DynamicTreeBuilder(2, 4, budget, root, r.params)
            jobs.append((r, rounds[round_index], DraftJob(r, builder)))
        trees = worker.propose([job for _, _, job in jobs]).trees
        bm.check_invariants()
        for r, want_accepted, job in jobs:
            tree = trees[r.request_id]
            # Accept a random-length path that exists in the verified tree.
            path, node = [], -1
            for _ in range(want_accepted):
                kids = tree.children(node)
                if not kids:
                    break
                node = kids[len(path) % len(kids)]
                path.append(tree.tokens[node])
            worker.commit(r.request_id, path)
            r.output_token_ids.extend(path + [VOCAB - 1])  # accepted tokens + the bonus
            # Right after the verify step only the request's own sequence remains, and it
            # holds exactly the KV of prompt + kept path: no rejected branch survives.
            assert bm.sequences().count(r.request_id) == 1
            assert not [s for s in bm.sequences() if s.startswith(r.request_id + "\x00")]
            assert bm.num_tokens(r.request_id) <= r.num_tokens - 1
        bm.check_invariants()
        held = {b for s in bm.sequences() for b in bm.block_table(s)}
        assert bm.num_free_blocks == bm.num_blocks - len(held)
        for s in bm.sequences():
            assert len(bm.block_table(s)) == -(-bm.num_tokens(s) // block_size)
    for r in requests:
        worker.release(r.request_id)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert worker.num_requests == 0
