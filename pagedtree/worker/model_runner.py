"""Runs a step plan on one model: batch tensors, forward, logits, sampling."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagedtree.scheduler.plan import ScheduledChunk, StepPlan
from pagedtree.worker.attention import AttentionMetadata, make_backend
from pagedtree.worker.models.decoder import DecoderForCausalLM
from pagedtree.worker.sampler import SampleResult, SamplingRow, sample


def kv_bytes_per_block(model: DecoderForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Memory one KV block takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


@dataclass(slots=True)
class StepOutput:
    """What one forward produced: a sample for every chunk that asked for logits."""

    samples: dict[str, SampleResult]


class ModelRunner:
    """Owns a model's KV cache and executes step plans against it."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        attention_backend: str,
    ):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(model.num_layers)
        ]
        self.attention = make_backend(attention_backend, self.kv_caches, model.head_dim**-0.5)
        self._generators: dict[str, torch.Generator] = {}
        self.num_forward_passes = 0

    # ------------------------------------------------------------------ inputs
    def _metadata(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        for chunk in chunks:
            input_ids.extend(chunk.token_ids)
            positions.extend(chunk.positions)
            slots.extend(chunk.slot_mapping)
            query_start_loc.append(len(input_ids))
        dev = self.device
        meta = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=torch.as_tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            context_lens=[c.context_len for c in chunks],
            block_tables=[c.block_table for c in chunks],
            tree_parents=[c.tree_parents for c in chunks],
        )
        return (
            torch.as_tensor(input_ids, dtype=torch.long, device=dev),
            torch.as_tensor(positions, dtype=torch.long, device=dev),
            meta,
        )

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
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run ``plan``: copy-on-write copies, one forward, logits, and sampling."""
        if plan.block_copies:
            self.attention.copy_blocks([c.src for c in plan.block_copies], [c.dst for c in plan.block_copies])
        if not plan.chunks:
            return StepOutput(samples={})
        input_ids, positions, meta = self._metadata(plan.chunks)
        self.attention.begin_step(meta)
        hidden = self.model(input_ids, positions, self.attention)
        self.num_forward_passes += 1

        # Plain decoding samples from each chunk's last token (tree verification,
        # which needs every node's logits, will read rows from logits_from on).
        sampling = [
            (chunk, start + chunk.num_tokens - 1)
            for chunk, start in zip(plan.chunks, meta.query_start_loc)
            if chunk.logits_from is not None
        ]
        if not sampling:
            return StepOutput(samples={})
        rows = torch.as_tensor([row for _, row in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        results = sample(logits, [self._sampling_row(chunk) for chunk, _ in sampling])
        return StepOutput(samples={chunk.request.request_id: r for (chunk, _), r in zip(sampling, results)})

    def _sampling_row(self, chunk: ScheduledChunk) -> SamplingRow:
        request = chunk.request
        params = request.params
        generator = None if params.greedy else self.generator_for(request.request_id, request.sampling_seed)
        history = request.all_token_ids if params.repetition_penalty != 1.0 else ()
        return SamplingRow(
            params=params,
            history=history,
            num_output_tokens=len(request.output_token_ids),
            generator=generator,
        )
