"""Runs a step plan on one model: batch tensors, forward, logits, sampling."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pagedtree.attention import make_backend
from pagedtree.config import DEFAULT_CPU_KV_CACHE_MEMORY, CacheConfig, SchedulerConfig
from pagedtree.sampling import SamplingRow, sample_rows
from pagedtree.step_data import Phase, ScheduledChunk, SlotMove, StepPlan
from pagedtree.worker.step_output import StepOutput
from pagedtree.structured.matcher import fill_bitmasks
from pagedtree.uploads import StagedUpload
from pagedtree.worker.step_inputs import HostStep, InputFeed, TokenSources, host_step, input_feed, query_starts, \
    upload_step
from pagedtree.worker.cuda_graphs import CaptureReport, StepGraphs
from pagedtree.host_memory import lazily_zeroed, tune_host_allocator
from pagedtree.worker.models.decoder import DecoderForCausalLM

logger = logging.getLogger("pagedtree")


def kv_bytes_per_block(model: DecoderForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Memory one KV block takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


@dataclass(frozen=True, slots=True)
class DraftMemory:
    """What a draft model's cache and graphs will take on the target's device, counted
    when the target's cache is sized (the draft's weights are loaded by then and are
    in use already): ``bytes_per_block`` of the draft's KV for each of the target's
    blocks (a draft's cache grows with the target's, ``num_draft_kv_blocks``), plus
    ``extra_blocks`` of it for the trees' branches, plus ``graph_bytes`` its CUDA
    graphs hold. ``fixed_blocks`` (a set ``num_draft_kv_blocks``) replaces both block
    counts."""

    bytes_per_block: int
    extra_blocks: int
    graph_bytes: int = 0
    fixed_blocks: int | None = None

    def fixed_bytes(self) -> int:
        """Bytes that do not grow with the target's block count."""
        blocks = self.fixed_blocks if self.fixed_blocks is not None else self.extra_blocks
        return blocks * self.bytes_per_block + self.graph_bytes

    def bytes_per_target_block(self) -> int:
        """Bytes each block of the target's cache adds to this draft's."""
        return 0 if self.fixed_blocks is not None else self.bytes_per_block


def num_kv_blocks(model: DecoderForCausalLM, cache: CacheConfig, scheduler: SchedulerConfig, dtype: torch.dtype,
                  device: torch.device, max_model_len: int, graph_memory: int = 0,
                  drafts: Sequence[DraftMemory] = ()) -> int:
    """How many KV blocks the target's cache gets: ``num_kv_blocks`` if set, else what
    the memory budget holds (``kv_cache_memory`` on CPU, ``gpu_memory_utilization``
    of the device minus what is in use, room for activations, ``graph_memory``
    (what the target's CUDA graphs will hold) and the ``drafts``' caches and graphs
    on the same device, on CUDA), never more than every sequence at full length could
    use. On CPU ``kv_cache_memory`` is the target's cache alone."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = kv_bytes_per_block(model, cache.block_size, dtype)
    why = ""
    if device.type == "cuda":
        # Memory an earlier engine of this process let go of still counts as in use
        # until it is collected (objects in reference cycles) and handed back by
        # torch's caching allocator (the blocks it keeps): both first, then measure.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # the weights, the drafts' included
        # Leave room for activations of a full token budget (a generous estimate).
        activations = 16 * scheduler.max_num_batched_tokens * model.config.hidden_size * 4 + (1 << 30)
        share = int(total * cache.gpu_memory_utilization)
        # The graphs' pool is private: eager steps cannot use it, nor the cache.
        budget = share - used - activations - graph_memory
        # Each draft's cache grows with the target's: one target block costs its own
        # bytes and every draft's.
        draft_bytes = sum(draft.fixed_bytes() for draft in drafts)
        budget -= draft_bytes
        blocks = max(budget, 0) // (per_block + sum(draft.bytes_per_target_block() for draft in drafts))
        why = (f": gpu_memory_utilization {cache.gpu_memory_utilization} of {_gib(total)} is {_gib(share)}, "
               f"less {_gib(used)} in use ({cuda_memory_in_use(device, used)}), {_gib(activations)} for "
               f"activations, {_gib(graph_memory)} for the CUDA graphs and {_gib(draft_bytes)} for the drafts")
    else:
        budget = cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        blocks = budget // per_block
    useful = scheduler.max_num_seqs * -(-max_model_len // cache.block_size) + 1
    blocks = min(blocks, useful)
    if blocks < 2:
        raise ValueError(f"the KV cache budget ({budget} bytes) holds fewer than 2 blocks of {per_block} bytes"
                         + (" (with the draft models' caches)" if drafts else "") + why)
    return int(blocks)


def cuda_memory_in_use(device: torch.device, used: int) -> str:
    """Who holds the ``used`` bytes of ``device``, as far as this process can tell:
    its tensors (torch's allocator), the blocks its allocator keeps cached, and the
    rest (CUDA contexts, other processes, memory outside torch's allocator)."""
    tensors = torch.cuda.memory_allocated(device)
    cached = max(torch.cuda.memory_reserved(device) - tensors, 0)
    rest = max(used - tensors - cached, 0)
    return (f"{_gib(tensors)} by this process's tensors, {_gib(cached)} cached by its allocator, "
            f"{_gib(rest)} by the rest: CUDA contexts and other processes")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def measure_cuda_graph_memory(model: DecoderForCausalLM, block_size: int, device: torch.device,
                              kv_dtype: torch.dtype, max_num_seqs: int, max_model_len: int,
                              max_tree_tokens: int) -> int:
    """Device memory the CUDA graphs of a runner with these limits hold (their shared
    pool and every shape's static buffers), measured before the KV cache is sized, so
    that the cache leaves room for them: a runner with a one-block cache captures
    every shape (``StepGraphs.capture_all``) and is dropped. A graph holds the
    addresses of the cache it was captured on, so the engine's runner captures its
    own afterwards; the Triton kernels compiled here serve it without compiling
    again. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    probe = ModelRunner(model, 1, block_size, device, kv_dtype, "triton")
    graphs = StepGraphs(probe, max_num_seqs, max_model_len, max_tree_tokens, capture=True)
    report = graphs.capture_all(log=False)
    del graphs, probe
    gc.collect()  # the graphs and the runner refer to each other
    torch.cuda.empty_cache()
    logger.info("CUDA graphs: %d shapes take %.0f MiB (measured in %.1f s), held back from the KV cache",
                report.captured, report.memory_bytes / 2**20, report.seconds)
    return max(0, report.memory_bytes)


def num_draft_kv_blocks(cache: CacheConfig, max_num_seqs: int, max_tree_nodes: int, target_blocks: int) -> int:
    """A draft's cache: as many blocks as the target's, plus every request's tree
    branches (each fed node may take a copy-on-write copy or a fresh block), unless
    ``num_draft_kv_blocks`` says otherwise."""
    if cache.num_draft_kv_blocks is not None:
        return cache.num_draft_kv_blocks
    return target_blocks + tree_branch_blocks(max_num_seqs, max_tree_nodes)


def tree_branch_blocks(max_num_seqs: int, max_tree_nodes: int) -> int:
    """Blocks a draft's cache holds beyond the target's: every request's tree
    branches (each fed node may take a copy-on-write copy or a fresh block)."""
    return max_num_seqs * (max_tree_nodes + 2)


class ModelRunner:
    """Owns a model's KV cache and executes step plans against it."""

    # Whether a step may take input tokens from the device (``forward``'s sources and
    # feeds): every rank must see a step's tokens, and other ranks get them from the host.
    takes_device_inputs = True

    def __init__(
        self,
        model: DecoderForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        attention_backend: str,
        fused_cpu_ops: bool = False,
    ):
        if device.type == "cpu":
            tune_host_allocator()  # before the cache and the first step allocate
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # The Triton backend's caches get one scratch block past the block manager's:
        # padding tokens of a CUDA-graph step write there (``cuda_graphs.py``).
        self.scratch_block = num_blocks if attention_backend == "triton" else None
        cache_blocks = num_blocks + (self.scratch_block is not None)
        shape = (cache_blocks, block_size, model.num_kv_heads, model.head_dim)
        # On CPU the cache's pages become resident as blocks are first written.
        zeroed = (lambda: lazily_zeroed(shape, kv_dtype)) if device.type == "cpu" else \
            (lambda: torch.zeros(shape, dtype=kv_dtype, device=device))
        self.kv_caches = [(zeroed(), zeroed()) for _ in range(model.num_layers)]
        self.attention = make_backend(attention_backend, self.kv_caches, model.head_dim**-0.5)
        # The decoder's residual adds, norms and rotary in numba kernels (fp32/bf16 on
        # CPU; a no-op elsewhere or without numba).
        self.fused_cpu_ops = fused_cpu_ops and model.enable_fused_cpu_ops()
        self._generators: dict[str, torch.Generator] = {}
        self._upload = StagedUpload(device, torch.long)
        self.graphs: StepGraphs | None = None
        self.num_forward_passes = 0
        # Counted on every rank alike: tensor-parallel ranks that ran the same steps agree.
        self.num_block_copies = 0
        self.num_slot_copies = 0
        self.closed = False

    def close(self) -> None:
        """Let go of everything that holds device memory: the CUDA graphs (and their
        pool), the KV cache, the attention backend and the model. A shut-down engine
        may still be referenced (``llm = LLM(...)`` rebinds ``llm`` only once the new
        engine has sized its cache from the free memory), so its memory is freed here
        rather than when it is collected. The runner cannot run afterwards; its
        counters stay. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.graphs = None  # the graphs and the runner refer to each other
        self.kv_caches = []
        self._generators.clear()
        del self.attention, self.model, self._upload

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this runner holds on its device: weights (this rank's shard) and KV cache."""
        if self.closed:
            return {"weights": 0, "kv_cache": 0}
        kv = sum(t.numel() * t.element_size() for pair in self.kv_caches for t in pair)
        return {"weights": self.model.weight_bytes(), "kv_cache": kv}

    # ------------------------------------------------------------------ state
    def generator_for(self, request_id: str, seed: int) -> torch.Generator:
        """The request's own RNG (kept across steps and preemptions until released)."""
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget per-request state of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)

    # ------------------------------------------------------------------ execute
    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk], logit_rows: Sequence[int],
                token_sources: TokenSources | None = None, feed: InputFeed | None = None) -> torch.Tensor:
        """One forward over the chunks' new tokens; the logits ``[len(logit_rows), V]``
        of the given rows of the step's flat run of tokens (``query_starts``).

        ``token_sources`` (request id -> a device tensor and a row of it) give the
        input token of each chunk scheduled ahead, drawn by a step not read back yet:
        copied into the step's uploaded inputs on the device, no host read; ``feed``
        gives them by chunk instead (a whole draft's levels: ``draft_levels.py``).

        Decode and verify steps go through the CUDA graphs when they are on (a
        replay that fails raises, as an eager step would)."""
        self.num_forward_passes += 1
        if feed is None:
            feed = input_feed(chunks, token_sources)
        graphs = self.graphs
        shape = graphs.shape_for(chunks) if graphs is not None else None
        if shape is not None:
            return graphs.forward(chunks, list(logit_rows), shape, feed)
        return self.run_step(host_step(chunks, logit_rows), feed)

    @torch.inference_mode()
    def run_step(self, step: HostStep, feed: InputFeed | None = None) -> torch.Tensor:
        """One eager forward over a step built on the host; the logits of its ``logit_rows``.

        (The tensor-parallel runner of rank 0 overrides it to send the step to the
        other ranks, which run this very method on their shards.)"""
        input_ids, positions, meta, rows = upload_step(step, self._upload, self.block_size)
        if feed is not None:
            feed.apply(input_ids, step.query_starts)  # chunk i starts at query_starts[i]
        self.attention.begin_step(meta)
        return self.run_model(input_ids, positions, rows)

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        """The model over a step whose attention metadata is in place; the logits of
        ``rows`` (every row when None)."""
        hidden = self.model(input_ids, positions, self.attention)
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, max_tree_tokens: int,
                           capture: bool) -> CaptureReport:
        """Run decode and verify steps (trees of up to ``max_tree_tokens`` tokens with
        their root) padded to static shapes, every shape captured as a CUDA graph here
        and now when ``capture`` (``cuda_graphs.py``: a shape whose capture fails runs
        eagerly); ``capture=False`` prepares every shape's static buffers and runs the
        same padded steps eagerly (how a CPU tests them)."""
        self.graphs = StepGraphs(self, max_num_seqs, max_model_len, max_tree_tokens, capture)
        return self.graphs.capture_all()

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole KV blocks (copy-on-write orders) in every layer."""
        if src:
            self.num_block_copies += len(src)
            self.attention.copy_blocks(src, dst)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Move single token slots in every layer (tree-path compaction)."""
        if src:
            self.num_slot_copies += len(src)
            self.attention.copy_slots(src, dst)

    def apply_slot_moves(self, moves: list[SlotMove]) -> None:
        """The plan's slot moves (accepted tree paths into sequence order), all layers at once."""
        if moves:
            self.copy_slots([m.src for m in moves], [m.dst for m in moves])

    @torch.inference_mode()
    def execute(self, plan: StepPlan, token_sources: TokenSources | None = None) -> StepOutput:
        """Run ``plan``: copy-on-write copies, one forward, logits, and draws.

        Plain chunks draw from their last token; VERIFY chunks get the logits of
        every row (root and tree nodes), which the speculator verifies. Nothing is
        read back here (``StepOutput.read_back``). ``token_sources``: see ``forward``.
        """
        if plan.block_copies:
            self.copy_blocks([c.src for c in plan.block_copies], [c.dst for c in plan.block_copies])
        if not plan.chunks:
            return StepOutput()
        sampling: list[ScheduledChunk] = []
        verify: list[ScheduledChunk] = []
        rows: list[int] = []
        verify_rows: list[int] = []
        for chunk, start in zip(plan.chunks, query_starts(plan.chunks)):
            if chunk.logits_from is None:
                continue
            if chunk.phase == Phase.VERIFY:
                verify.append(chunk)
                verify_rows.extend(range(start + chunk.logits_from, start + chunk.num_tokens))
            else:
                sampling.append(chunk)
                rows.append(start + chunk.num_tokens - 1)
        rows += verify_rows
        logits = self.forward(plan.chunks, rows, token_sources)  # no rows: prefill chunks that need no logits yet
        out = StepOutput()
        if sampling:
            sampling_rows = [self._sampling_row(chunk) for chunk in sampling]
            constrained = [i for i, chunk in enumerate(sampling) if chunk.request.grammar is not None]
            if constrained:  # the grammars' masks in one fill (xgrammar threads over the rows)
                grammars = [sampling[i].request.grammar for i in constrained]
                masks = fill_bitmasks([g.matcher for g in grammars], grammars[0].width)
                for k, i in enumerate(constrained):
                    sampling_rows[i].bitmask = masks[k]
            drawn = sample_rows(logits[: len(sampling)], sampling_rows)
            out.sample_groups.append(([chunk.request.request_id for chunk in sampling], drawn))
        offset = len(sampling)
        for chunk in verify:
            n = chunk.num_tokens - chunk.logits_from
            out.verify_logits[chunk.request.request_id] = logits[offset : offset + n]
            offset += n
        return out

    def _sampling_row(self, chunk: ScheduledChunk) -> SamplingRow:
        request = chunk.request
        params = request.params
        seeded = params.seed is not None
        generator = None if params.greedy or seeded else self.generator_for(request.request_id, request.sampling_seed)
        history = request.all_token_ids if params.repetition_penalty != 1.0 else ()
        return SamplingRow(
            params=params,
            history=history,
            # A decode scheduled ahead draws that many output positions further on.
            num_output_tokens=len(request.output_token_ids) + chunk.pending_tokens,
            generator=generator,
            coupling_seed=request.sampling_seed if seeded and not params.greedy else None,
        )
