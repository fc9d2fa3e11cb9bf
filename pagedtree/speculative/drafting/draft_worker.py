"""The draft worker: a draft model with its own paged KV cache that grows token trees.

Each request's draft KV lives in a sequence of the draft's own ``BlockManager``. To
grow a tree, the worker first feeds the tokens the draft has not seen yet (the
request's newest token is the tree's root), then one tree level per forward: every
node to expand becomes a forked sequence that shares its parent's blocks
copy-on-write and decodes its own token. All requests' nodes of a level go into one
batched draft forward, and all their children are drawn on the device and read back
in one copy (one sync per level). Static trees without a grammar are drafted whole:
every node's slot reserved first, every level queued on the worker with its input
tokens taken on the device, one readback a draft (``_propose_whole``,
``worker/draft_levels.py``).

Each draft forward is timed for the cost model without a sync of its own
(``ForwardTimer``) and returned with the trees (``Drafted.forwards``).

After verification, ``commit`` keeps the one branch that holds the longest accepted
path (its KV is already in sequence order) and frees every other branch at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedtree.request import Request
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.step_data import BlockCopy, Phase, ScheduledChunk
from pagedtree.speculative.drafting.builders import ShapeTreeBuilder, StagedChildren, read_children
from pagedtree.speculative.drafting.drafter import Drafted, DraftJob
from pagedtree.speculative.tree import ROOT, ChildDraw, TokenTree
from pagedtree.draft_sampling import DraftLevel
from pagedtree.worker.draft_levels import ForwardTimer, draft_forward, run_draft_levels
from pagedtree.worker.model_runner import ModelRunner
from pagedtree.sampling import DRAFT_STREAM, stream_seed

logger = logging.getLogger("pagedtree")


@dataclass(slots=True)
class _Branches:
    """The forked sequences of one request's tree, kept until ``commit``."""

    root_len: int  # the request's tokens when drafting began (root = last of them)
    tree: TokenTree  # the builder's full tree (before any pruning)
    seq_of: dict[int, str] = field(default_factory=dict)  # fed node -> sequence holding its path
    seqs: list[str] = field(default_factory=list)


def _drafts_whole(job: DraftJob) -> bool:
    """Whether the job's tree can be drafted whole (``ShapeTreeBuilder.drafts_whole``)."""
    builder = job.builder
    return isinstance(builder, ShapeTreeBuilder) and builder.drafts_whole()


class DraftWorker:
    """Owns one draft model, its KV cache and block manager (see module docstring); a
    ``Drafter`` whose jobs carry their tree builders."""

    needs_builder = True

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, name: str = "draft", index: int = 0,
                 model_path: str | None = None):
        self.runner = runner
        self.model_path = model_path  # where its weights came from (keys its cost calibration)
        self.block_manager = block_manager
        self.name = name
        self.index = index  # among the engine's draft models: keys this draft's random stream
        self._computed: dict[str, int] = {}
        self._branches: dict[str, _Branches] = {}
        self.num_forward_passes = 0
        # Whole drafts (``_propose_whole``): every node's slot reserved first, then all
        # levels queued on the worker, each level's input tokens taken on the device,
        # every level read back at once. On a GPU a level's readback is a sync the
        # host's next level waits for.
        self.whole_drafts = getattr(runner, "takes_device_inputs", False)

    def generator_for(self, request: Request) -> torch.Generator:
        """The request's random stream for drawing this draft's children.

        Apart from the target's stream and from every other draft model's: the
        verifier treats the children of different drafts as independent draws.
        """
        seed = stream_seed(request.sampling_seed, DRAFT_STREAM, self.index)
        return self.runner.generator_for(request.request_id, seed)

    # --------------------------------------------------------------- propose
    def propose(self, jobs: Sequence[DraftJob]) -> Drafted:
        """Grow every job's tree: trees by request id (jobs without room get none) and
        the timed forwards."""
        if self.whole_drafts and jobs and all(_drafts_whole(job) for job in jobs):
            return self._propose_whole(jobs)
        copies: list[BlockCopy] = []
        level: list[tuple[DraftJob, int, ScheduledChunk]] = []
        for job in jobs:
            chunk = self._catch_up_chunk(job.request, copies)
            if chunk is not None:
                level.append((job, ROOT, chunk))
        out = Drafted()
        while level:
            chunks = [chunk for _, _, chunk in level]
            logits, timer = self._forward(copies, chunks)
            copies = []
            fed_by_job: dict[int, tuple[DraftJob, list[tuple[int, torch.Tensor]]]] = {}
            for (job, node, _), row in zip(level, logits):
                fed_by_job.setdefault(id(job), (job, []))[1].append((node, row))
            # Every request's children of this level are drawn on the device, then
            # read back in one copy: one sync per draft level.
            staged = [(job, job.builder.stage_level(fed)) for job, fed in fed_by_job.values()]
            read_children([children for _, picks in staged for children in picks])
            # After the readback: on CUDA the forward has run (a level whose
            # readback copied nothing leaves it unmeasured rather than sync for it).
            seconds = timer.seconds()
            if seconds is not None:
                out.forwards.append((sum(c.num_tokens for c in chunks), seconds))
            level = []
            for job, picks in staged:
                level.extend(self._branch_chunks(job, job.builder.grow(picks), copies))
        for job in jobs:
            rid = job.request.request_id
            if rid in self._branches:
                out.trees[rid] = job.builder.finish()
        return out

    def _propose_whole(self, jobs: Sequence[DraftJob]) -> Drafted:
        """Static trees without a grammar (``ShapeTreeBuilder.drafts_whole``): every
        node's sequence and slot reserved at once (``_reserve_levels``), every level
        run on the worker back to back (``run_draft_levels``: each level's input
        tokens are the children drawn the level before, on the device), every level's
        children read back in one copy, then each tree grown on the host as
        ``propose`` grows it level by level. Where no drawn token is dropped, the same
        trees, draws and KV slots as level by level; a node whose token the rule could
        not draw, or a repeated i.i.d. draw, is fed all the same, its children then
        dropped with it and its KV at ``commit``."""
        levels, placed = self._reserve_levels(jobs)
        run = run_draft_levels(self.runner, levels)
        self.num_forward_passes += len(levels)
        staged: list[dict[int, StagedChildren]] = [{} for _ in jobs]  # per job, by shape node
        seq_of_shape: list[dict[int, str]] = [{} for _ in jobs]
        for level, level_children in zip(placed, run.children):
            for (job_index, shape_node, seq), children in zip(level, level_children):
                seq_of_shape[job_index][shape_node] = seq
                draw = ChildDraw(jobs[job_index].builder.rule, ROOT, probs=children.probs)
                staged[job_index][shape_node] = StagedChildren(
                    ROOT, None, None, draw, host_tokens=children.tokens, host_increments=children.increments)
        out = Drafted(forwards=run.forwards)
        for job_index, job in enumerate(jobs):
            rid = job.request.request_id
            branches = self._branches.get(rid)
            if branches is None:
                continue  # no room for its catch-up
            tree_of = job.builder.grow_drawn(staged[job_index])
            for shape_node, seq in seq_of_shape[job_index].items():
                if shape_node in tree_of:
                    branches.seq_of[tree_of[shape_node]] = seq
            branches.tree = job.builder.tree
            out.trees[rid] = job.builder.finish()
        return out

    def _reserve_levels(self, jobs: Sequence[DraftJob]) -> tuple[list[DraftLevel], list[list[tuple[int, int, str]]]]:
        """Every level of a whole draft with its slots reserved, before any forward:
        the catch-up chunks, then per level each job's shape nodes that have children
        (a node's first fed child takes its sequence over, the others fork it), in the
        order and with the blocks that drafting level by level takes; and per level,
        which (job, shape node, sequence) each chunk feeds."""
        copies: list[BlockCopy] = []
        chunks, rules, where = [], [], []
        fed: list[tuple[int, int, int, str]] = []  # this level's (job, shape node, chunk, sequence)
        for job_index, job in enumerate(jobs):
            chunk = self._catch_up_chunk(job.request, copies)
            if chunk is not None:
                chunks.append(chunk)
                rules.append(job.builder.child_rule(ROOT, 0))
                where.append((job_index, ROOT, job.request.request_id))
                fed.append((job_index, ROOT, len(chunks) - 1, job.request.request_id))
        levels = [DraftLevel(chunks, rules, [None] * len(chunks), copies)]
        placed = [where]
        depth = 0
        while fed:
            depth += 1
            copies, chunks, rules, feeds, where, next_fed = [], [], [], [], [], []
            for job_index in dict.fromkeys(j for j, _, _, _ in fed):
                job = jobs[job_index]
                rid = job.request.request_id
                builder = job.builder
                nodes = [(kid, rank, parent_chunk, seq) for j, parent, parent_chunk, seq in fed if j == job_index
                         for rank, kid in enumerate(builder.shape_children(parent)) if builder.shape_children(kid)]
                position = self._branches[rid].root_len - 1 + depth
                placed_nodes = self._place_nodes(
                    job.request, [(seq, f"s{kid}", position, None) for kid, _, _, seq in nodes], copies)
                for (kid, rank, parent_chunk, _), (seq, chunk) in zip(nodes, placed_nodes):
                    chunks.append(chunk)
                    rules.append(builder.child_rule(kid, depth))
                    feeds.append((parent_chunk, rank))
                    where.append((job_index, kid, seq))
                    next_fed.append((job_index, kid, len(chunks) - 1, seq))
            if chunks:
                levels.append(DraftLevel(chunks, rules, feeds, copies))
                placed.append(where)
            fed = next_fed
        return levels, placed

    def _catch_up_chunk(self, request: Request, copies: list[BlockCopy]) -> ScheduledChunk | None:
        """Feed the tokens the draft has not seen, ending with the root; None if no room."""
        bm = self.block_manager
        rid = request.request_id
        n = request.num_tokens
        tokens = request.all_token_ids
        if not bm.has_sequence(rid):
            if not bm.can_allocate(tokens):
                return None
            self._computed[rid] = bm.allocate(rid, tokens)
        else:
            need = n - bm.num_tokens(rid)
            if need > 0 and not bm.can_append_slots(rid, need):
                self.release(rid)  # recomputed from scratch when there is room again
                return None
            copies.extend(bm.append_slots(rid, max(need, 0)))
        start = self._computed[rid]
        self._computed[rid] = n
        self._branches[rid] = _Branches(root_len=n, tree=TokenTree(tokens[-1]), seq_of={ROOT: rid}, seqs=[rid])
        return ScheduledChunk(
            request=request,
            phase=Phase.DRAFT,
            token_ids=tokens[start:n],
            positions=list(range(start, n)),
            slot_mapping=bm.slots(rid, start, n),
            block_table=bm.block_table(rid),
            context_len=n,
            logits_from=n - start - 1,
        )

    def _branch_chunks(
        self, job: DraftJob, nodes: list[int], copies: list[BlockCopy]
    ) -> list[tuple[DraftJob, int, ScheduledChunk]]:
        """The chunks feeding a level's nodes of one tree (``_place_nodes``)."""
        branches = self._branches[job.request.request_id]
        branches.tree = tree = job.builder.tree
        placed = self._place_nodes(job.request, [
            (branches.seq_of[tree.parents[node]], str(node), branches.root_len - 1 + tree.depths[node],
             tree.tokens[node]) for node in nodes], copies)
        out = []
        for node, (seq, chunk) in zip(nodes, placed):
            branches.seq_of[node] = seq
            out.append((job, node, chunk))
        return out

    def _place_nodes(self, request: Request, nodes: list[tuple[str, str, int, int | None]],
                     copies: list[BlockCopy]) -> list[tuple[str, ScheduledChunk]]:
        """A sequence and a KV slot for each node to feed, given as (its parent's
        sequence, a name for a fork of it, its position, its token: None for one the
        forward takes on the device): the first node below a parent takes the parent's
        sequence over, the others fork it. Only as many nodes as there are free blocks
        (each costs at most one: a copy-on-write copy or a fresh block). Returns each
        placed node's sequence and the chunk feeding it, in order."""
        bm = self.block_manager
        rid = request.request_id
        nodes = nodes[: bm.num_free_blocks]
        claimed: set[str] = set()
        seqs = []
        for parent_seq, name, _, _ in nodes:
            if parent_seq not in claimed:
                claimed.add(parent_seq)
                seqs.append(parent_seq)
            else:
                child_seq = f"{rid}\x00{self.name}\x00{name}"
                bm.fork(parent_seq, child_seq)
                self._branches[rid].seqs.append(child_seq)
                seqs.append(child_seq)
        out = []
        for seq, (_, _, position, token) in zip(seqs, nodes):
            # Forks first, then appends: every sibling sees the parent's blocks unchanged.
            copies.extend(bm.append_slots(seq, 1))
            chunk = ScheduledChunk(
                request=request, phase=Phase.DRAFT, token_ids=[0 if token is None else token], positions=[position],
                slot_mapping=[bm.slot(seq, position)], block_table=bm.block_table(seq), context_len=position + 1,
                logits_from=0, pending_tokens=1 if token is None else 0,
            )
            out.append((seq, chunk))
        return out

    def _forward(self, copies: list[BlockCopy], chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, ForwardTimer]:
        """One draft level (``draft_levels.draft_forward``), counted."""
        self.num_forward_passes += 1
        return draft_forward(self.runner, chunks, copies)

    # ---------------------------------------------------------------- commit
    def commit(self, request_id: str, accepted_tokens: Sequence[int]) -> None:
        """Keep the KV of the longest fed prefix of ``accepted_tokens``; free the rest."""
        branches = self._branches.pop(request_id, None)
        if branches is None:
            return
        tree = branches.tree
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            kids.setdefault(p, []).append(i)
        node, depth, fed_node, fed_depth = ROOT, 0, ROOT, 0
        for token in accepted_tokens:
            matches = [c for c in kids.get(node, []) if tree.tokens[c] == token]
            if not matches:
                break
            # Prefer a duplicate sibling that was fed (its KV exists).
            node = next((c for c in matches if c in branches.seq_of), matches[0])
            depth += 1
            if node in branches.seq_of:
                fed_node, fed_depth = node, depth
        keep = branches.seq_of[fed_node]
        bm = self.block_manager
        for seq in branches.seqs:
            if seq != keep:
                bm.free(seq)
        if keep != request_id:
            bm.rename(keep, request_id)
        computed = branches.root_len + fed_depth
        bm.truncate(request_id, computed)
        self._computed[request_id] = computed

    def cache_blocks(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Make the draft's full computed blocks of a request findable by prefix."""
        if self.block_manager.has_sequence(request_id):
            self.block_manager.cache_computed_blocks(request_id, token_ids, self._computed[request_id])

    def release(self, request_id: str) -> None:
        """Free everything the draft holds for a request (finished, preempted, failed)."""
        bm = self.block_manager
        branches = self._branches.pop(request_id, None)
        seqs = branches.seqs if branches is not None else [request_id]
        for seq in seqs:
            if bm.has_sequence(seq):
                bm.free(seq)
        self._computed.pop(request_id, None)
        self.runner.release([request_id])

    def backlog(self, request: Request) -> int:
        """Tokens of ``request`` this draft has not computed yet, the newest (the next
        tree's root) not counted."""
        return max(0, request.num_tokens - 1 - self._computed.get(request.request_id, 0))

    @property
    def num_requests(self) -> int:
        """Requests whose KV the draft holds."""
        return len(self._computed)
