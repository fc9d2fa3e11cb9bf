"""Where a server's memory goes between identical rounds of load: tracemalloc and the C heap.

Serves a model in this process (an ``AsyncEngine`` behind the aiohttp app, on a
thread) with ``tracemalloc`` on, and drives it from a separate process with the
soak's client mix (``python -m pagedtree.loadgen.soak --requests-per-loop N``: the
same requests every round). After every round it waits until the engine is idle,
collects garbage, and records the RSS, glibc's heap in use (``mallinfo2``), Python's
allocated blocks, the objects the collector tracks by type, and a tracemalloc
snapshot. It prints, and writes as JSON and markdown under ``--out-dir``, the figures
per round (with the objects only the cycle collector frees) and the top growth sites between the end of the warm-up round and the
last round.

    python benchmarks/memory_trace.py --model smollm2-135m-instruct --rounds 5
    git worktree add /tmp/before <commit>
    python benchmarks/memory_trace.py --source /tmp/before --tag before   # an earlier version

Python objects show up in tracemalloc; memory that C libraries allocate (oneDNN,
the tokenizers, torch tensors' storage) only in the heap and RSS columns.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_in_use() -> int | None:
    # Read here rather than through pagedtree: an earlier version (--source) lacks it.
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return int(libc.mallinfo2().uordblks)
    except (OSError, AttributeError):
        return None


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child(args: argparse.Namespace) -> dict:
    tracemalloc.start(args.frames)
    import uvloop
    from aiohttp import web

    from pagedtree.engine.async_engine import AsyncEngine
    from pagedtree.entrypoints.api_server import app_runner, build_app

    kwargs = {"device": "cpu", "max_model_len": args.max_model_len}
    if args.suffix:
        kwargs["speculative"] = {"drafter": "suffix"}
    engine = AsyncEngine(args.model, max_waiting_requests=256, **kwargs)
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    app = build_app(engine, model_name="m")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def setup() -> None:
        runner = app_runner(app, shutdown_timeout=5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    asyncio.run_coroutine_threadsafe(setup(), loop).result()
    url = f"http://127.0.0.1:{port}"
    rounds: list[dict] = []
    snapshots: list[tracemalloc.Snapshot] = []  # after the warm-up rounds, and the last
    own_blocks = own_traced = 0
    client_env = dict(os.environ, PYTHONPATH=str(ROOT))  # the clients are this checkout's
    for index in range(args.rounds):
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pagedtree.loadgen.soak", "--url", url, "--requests-per-loop",
                              str(args.requests_per_loop), "--clients", args.clients, "--seed", "1"],
                             capture_output=True, text=True, env=client_env, cwd=ROOT, check=True)
        while engine.num_active_requests:
            time.sleep(0.2)
        time.sleep(2.0)  # past the idle heap trim, where there is one
        # What only the cycle collector frees (it grows between full collections).
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage = collections.Counter(type(o).__name__ for o in gc.garbage)
        gc.garbage.clear()
        gc.set_debug(0)
        gc.collect()
        counts = json.loads(out.stdout)["by_kind"]
        # Read before this round's snapshot exists (snapshots are Python objects too).
        reading = {"round": index, "seconds": time.monotonic() - started, "rss": _rss(),
                   "heap_in_use": _heap_in_use(), "python_blocks": sys.getallocatedblocks() - own_blocks,
                   "traced": tracemalloc.get_traced_memory()[0] - own_traced,
                   "requests": sum(sum(v.values()) for v in counts.values()),
                   "cyclic_garbage": sum(garbage.values()), "garbage_types": dict(garbage.most_common(8))}
        reading["by_type"] = collections.Counter(type(o).__name__ for o in gc.get_objects())
        rounds.append(reading)
        if index == args.warm_rounds or index == args.rounds - 1:
            blocks, traced = sys.getallocatedblocks(), tracemalloc.get_traced_memory()[0]
            snapshot = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)])
            snapshots.append(snapshot)
            # The snapshot is kept: later readings leave out what it takes.
            own_blocks += sys.getallocatedblocks() - blocks
            own_traced += tracemalloc.get_traced_memory()[0] - traced
        print(f"round {index}: RSS {rounds[-1]['rss'] / 2**20:.0f} MiB, heap in use "
              f"{(rounds[-1]['heap_in_use'] or 0) / 2**20:.0f} MiB, Python blocks {rounds[-1]['python_blocks']}, "
              f"traced {rounds[-1]['traced'] / 2**20:.1f} MiB, cyclic garbage {rounds[-1]['cyclic_garbage']} objects",
              flush=True)
    base = args.warm_rounds
    stats = snapshots[-1].compare_to(snapshots[0], "lineno")
    top = [{"site": str(s.traceback[0]), "size_diff": s.size_diff, "count_diff": s.count_diff}
           for s in stats[:args.top]]
    types = rounds[-1]["by_type"] - rounds[base]["by_type"]
    for r in rounds:
        del r["by_type"]
    asyncio.run_coroutine_threadsafe(engine.shutdown(), loop).result(60)
    return {"tag": args.tag, "model": args.model, "suffix": args.suffix, "clients": args.clients,
            "requests_per_loop": args.requests_per_loop, "rounds": rounds, "top_growth": top,
            "gc_objects_growth": dict(types.most_common(args.top))}


def markdown(result: dict, warm_rounds: int) -> str:
    rows = ["| round | requests | RSS MiB | heap in use MiB | Python blocks | traced MiB | cyclic garbage (objects) |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rounds"]:
        rows.append(f"| {r['round']} | {r['requests']} | {r['rss'] / 2**20:.0f} | {(r['heap_in_use'] or 0) / 2**20:.0f} | "
                    f"{r['python_blocks']} | {r['traced'] / 2**20:.1f} | {r.get('cyclic_garbage', '')} |")
    rows += ["", f"Top growth sites (tracemalloc, round {warm_rounds} -> round {result['rounds'][-1]['round']}):", "",
             "| site | size | blocks |", "|---|---:|---:|"]
    rows += [f"| `{t['site']}` | {t['size_diff'] / 1024:+.1f} KiB | {t['count_diff']:+d} |" for t in result["top_growth"]]
    return "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--suffix", action="store_true", help="serve with the suffix drafter")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm-rounds", type=int, default=1, help="rounds before the growth baseline (default 1)")
    parser.add_argument("--requests-per-loop", type=int, default=8, help="requests each client loop sends a round")
    parser.add_argument("--clients", default="valid=3,disconnect=2,logprobs=1,hostile=2,long=1,huge=0,slowloris=0",
                        help="the soak's client loops (pagedtree.loadgen.soak.SoakClients)")
    parser.add_argument("--frames", type=int, default=1, help="tracemalloc frames per allocation (1 is fastest)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--source", default=None, help="serve from this checkout (an earlier version)")
    parser.add_argument("--out-dir", default="benchmarks/results/soak")
    parser.add_argument("--tag", default="trace")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    if args.child:
        result = child(args)
        (out_dir / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    source = Path(args.source).resolve() if args.source else ROOT
    env = dict(os.environ, PYTHONPATH=str(source))
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *sys.argv[1:],
                    "--out-dir", str(out_dir.resolve())], env=env, cwd=source, check=True)
    result = json.loads((out_dir / f"{args.tag}.json").read_text())
    text = markdown(result, args.warm_rounds)
    (out_dir / f"{args.tag}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
