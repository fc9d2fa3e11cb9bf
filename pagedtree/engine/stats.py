"""The engine's counters (``LLMEngine.stats()``, ``LLM.stats()``, the server's metrics)."""

from __future__ import annotations

from pagedtree.engine.build import EngineParts
from pagedtree.speculative.speculation import Speculation


def engine_stats(engine: EngineParts, speculation: Speculation, num_prompt_tokens: int,
                 num_failed_requests: int) -> dict[str, object]:
    """Counters of the cache, the scheduler, the work done so far, speculation's and
    the grammar compiler's."""
    bm, scheduler = engine.block_manager, engine.scheduler
    stats: dict[str, object] = {
        "num_total_blocks": bm.num_blocks,
        "num_free_blocks": bm.num_free_blocks,
        "num_cached_blocks": bm.num_cached_blocks,
        "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
        "kv_cache_usage": (bm.num_blocks - bm.num_free_blocks) / bm.num_blocks,
        "prefix_cache_queries": bm.prefix_cache_queries,
        "prefix_cache_hits": bm.prefix_cache_hits,
        "num_preemptions": scheduler.num_preemptions,
        "num_prompt_tokens": num_prompt_tokens,
        "num_generated_tokens": engine.output_processor.num_generated_tokens,
        "num_forward_passes": engine.runner.num_forward_passes,
        "num_requests_running": len(scheduler.running),
        "num_requests_waiting": len(scheduler.waiting),
        "num_failed_requests": num_failed_requests,
        "max_model_len": engine.max_model_len,
        "num_target_forward_passes": engine.runner.num_forward_passes,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
    }
    stats.update(speculation.stats())
    stats.update(engine.grammars.stats())
    return stats
