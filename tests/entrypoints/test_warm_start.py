"""Warm before ready: the first clients after ``/health`` says ok are served as fast as later ones."""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import pytest

from tests.entrypoints.test_soak import serve, stop

FIRST_OVER_WARM = 1.5


async def _batch(url: str, index: int, size: int = 8) -> float:
    """Seconds for ``size`` concurrent completions of distinct prompts (no prefix-cache hits)."""
    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {"prompt": f"Request {index}-{i}: write a short story about the number {index * 100 + i}.",
                "max_tokens": 16, "ignore_eos": True, "temperature": 0.8, "seed": i}
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()

    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, i) for i in range(size)))
    return time.perf_counter() - started


@pytest.mark.slow
def test_the_first_batch_after_ready_is_as_fast_as_a_warm_one():
    from pagedtree.loading import packaged_models as pm

    if not pm.is_installed(pm.SMOLLM2_135M):
        pytest.skip(f"{pm.SMOLLM2_135M.name} not installed: {pm.install_command(pm.SMOLLM2_135M)}")
    served = serve(pm.SMOLLM2_135M.name)
    try:
        first = asyncio.run(_batch(served.url, 0))
        warm = statistics.median(asyncio.run(_batch(served.url, i)) for i in range(1, 6))
    finally:
        stop(served)
    print(f"first batch {first:.2f} s, warm batches (median of 5) {warm:.2f} s: {first / warm:.2f}x")
    assert first <= FIRST_OVER_WARM * warm, (first, warm)
