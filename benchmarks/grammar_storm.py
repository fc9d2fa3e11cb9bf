"""A storm of slow grammar compiles against one cached constraint.

An ``AsyncEngine`` (the server's engine) gets ``--storm`` constrained requests whose
regexes take far longer than the compile time limit to compile, each from its own
client, all at once; a moment later a request whose constraint (``guided_choice``
yes/no) was compiled before. Reports how long the cached request took to be
accepted and to finish, and what became of the storm (refused at its time limit,
or with HTTP 429 at once). Uses only the public API, so any two commits compare
(``--client`` is passed where the engine takes it).

    python benchmarks/grammar_storm.py --storm 20 --timeout 10
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def slow_regex(i: int) -> str:
    """A regex whose compile takes seconds (its automaton explodes), distinct per ``i``."""
    return "(" + "|".join(f"[a-z]{{{k}}}x" for k in range(1, 2000)) + f")|{i}"


async def storm(model: str, count: int, timeout_s: float) -> dict:
    from pagedtree import SamplingParams
    from pagedtree.engine.async_engine import AsyncEngine
    from pagedtree.structured_params import StructuredOutputsParams

    engine = AsyncEngine(model, max_model_len=512, structured_output_limits={"compile_timeout_s": timeout_s})
    takes_client = "client" in inspect.signature(engine.add_request).parameters
    try:
        cached = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        async for _ in await engine.add_request("Hello", cached):
            pass

        async def one(i: int):
            params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=slow_regex(i)))
            extra = {"client": f"client-{i}"} if takes_client else {}
            started = time.perf_counter()
            try:
                await engine.add_request("Hello", params, **extra)
                return "accepted", time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001 - what the storm's requests got
                return type(exc).__name__, time.perf_counter() - started

        started = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) for i in range(count)]
        await asyncio.sleep(0.2)
        asked = time.perf_counter()
        stream = await engine.add_request("Hello", cached)
        accepted = time.perf_counter() - asked
        async for _ in stream:
            pass
        finished = time.perf_counter() - asked
        outcomes = await asyncio.gather(*tasks)
        total = time.perf_counter() - started
    finally:
        await engine.shutdown()
    kinds: dict[str, int] = {}
    for kind, _ in outcomes:
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(storm=count, timeout_s=timeout_s, cached_accepted_s=accepted, cached_finished_s=finished,
                storm_seconds=total, storm_outcomes=kinds, slowest_storm_answer_s=max(t for _, t in outcomes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--storm", type=int, default=20, help="slow compiles, each from its own client")
    parser.add_argument("--timeout", type=float, default=10.0, help="the compile time limit, seconds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = asyncio.run(storm(args.model, args.storm, args.timeout))
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
