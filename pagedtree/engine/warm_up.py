"""Paying an engine's first-use costs before it serves anyone.

The first step of each kind does work that later ones skip: numba kernels loaded
(or, on a fresh install, compiled: the seeded sampler's noise kernel took 0.6 s on
its first seeded request), oneDNN primitives created per row count, the long-chunk
attention path (SDPA), the heap grown to the step's size, lazily built tables. A
server that takes those on its first clients answers them late; ``warm_up`` runs a
small batch through the real step loop instead (a prompt longer than the in-place
attention kernel takes, greedy, seeded and unseeded sampling with logprobs,
penalties and ``n=2``), then puts the user-visible counters back, so ``/metrics``
and ``stats()`` count clients' requests only. The speculator sits the warm-up out
(its acceptance statistics and step timings must come from real requests; its
forwards were already run by the load-time calibration).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from pagedtree.sampling_params import SamplingParams

# The CPU attention kernel takes chunks of up to 64 new tokens; longer ones go to SDPA.
_LONG_PROMPT = 96
_NEW_TOKENS = 4


@dataclass(slots=True)
class WarmUpReport:
    """What the warm-up ran: requests, engine steps and seconds."""

    num_requests: int
    num_steps: int
    seconds: float


def warm_up(engine) -> WarmUpReport:
    """Run the warm-up batch on ``engine`` (an ``LLMEngine`` with no requests), then
    restore its counters; returns what it ran."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine")
    started = time.monotonic()
    counters = _Counters.read(engine)
    rng = random.Random(0)
    room = engine.max_model_len - _NEW_TOKENS
    long_len = max(1, min(_LONG_PROMPT, room))
    short_len = max(1, min(8, room))

    def prompt(length: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(engine.vocab_size) for _ in range(length)]}

    jobs = [
        (prompt(long_len), SamplingParams(temperature=0.0, max_tokens=_NEW_TOKENS, ignore_eos=True)),
        (prompt(short_len), SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=0, logprobs=2,
                                           repetition_penalty=1.1, max_tokens=_NEW_TOKENS, ignore_eos=True)),
        (prompt(short_len), SamplingParams(temperature=0.8, min_p=0.05, n=2, logprobs=0,
                                           max_tokens=_NEW_TOKENS, ignore_eos=True)),
    ]
    steps = 0
    # The speculator sits out: no acceptance evidence, suffix outputs or step timings
    # (cold ones would skew its cost model) from random prompts.
    saved_budget, engine.scheduler.budget_policy = engine.scheduler.budget_policy, None
    with engine.step_runner.speculation_paused():
        try:
            for index, (job_prompt, params) in enumerate(jobs):
                engine.add_request(f"warm-up-{index}", job_prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        finally:
            for index in range(len(jobs)):
                engine.abort_request(f"warm-up-{index}")
            counters.restore(engine)
            engine.scheduler.budget_policy = saved_budget
    return WarmUpReport(len(jobs), steps, time.monotonic() - started)


@dataclass(slots=True)
class _Counters:
    """The counters ``stats()`` reports of requests, kept across the warm-up (the
    forward-pass count is work done and stays, as every tensor-parallel rank's does)."""

    num_prompt_tokens: int
    num_generated_tokens: int
    num_failed_requests: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @classmethod
    def read(cls, engine) -> _Counters:
        return cls(engine.num_prompt_tokens, engine.output_processor.num_generated_tokens,
                   engine.num_failed_requests, engine.scheduler.num_preemptions,
                   engine.block_manager.prefix_cache_queries, engine.block_manager.prefix_cache_hits)

    def restore(self, engine) -> None:
        engine.num_prompt_tokens = self.num_prompt_tokens
        engine.output_processor.num_generated_tokens = self.num_generated_tokens
        engine.num_failed_requests = self.num_failed_requests
        engine.scheduler.num_preemptions = self.num_preemptions
        engine.block_manager.prefix_cache_queries = self.prefix_cache_queries
        engine.block_manager.prefix_cache_hits = self.prefix_cache_hits
