"""A server's memory over a long run: RSS sampled under mixed clients, with a plot.

Starts ``pagedtree serve`` in a process of its own, drives it with the soak's client
mix (``pagedtree.loadgen.soak``: valid, disconnecting, hostile, long-prompt, huge-prompt,
constrained, hostile-constraint and slowloris clients) for ``--duration`` seconds, samples the server's RSS and its
``/metrics`` memory gauges every ``--interval`` seconds, waits for the engine to go
idle, and reports the RSS after the warm-up, at the end, the slope of the last third
and the counts by client kind. Writes ``<tag>.json`` and ``<tag>.png`` (RSS, malloc
in use and malloc free over time) under ``--out-dir``; ``--plot A.json B.json ...``
draws several runs on one figure instead of running anything.

    python benchmarks/memory_soak.py --model smollm2-135m-instruct --duration 1800 --tag plain
    python benchmarks/memory_soak.py --model smollm2-135m-instruct --duration 1800 --tag suffix \\
        --server-args "--spec-drafter suffix"
    python benchmarks/memory_soak.py --plot benchmarks/results/soak/*.json --out benchmarks/results/soak/rss.png

``--source DIR`` serves from another checkout (``git worktree add /tmp/before <commit>``)
to measure an earlier version with the same clients. Run it on a quiet machine: the
clients share the machine with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedtree.loadgen.soak import (  # noqa: E402
    MemorySampler,
    SoakClients,
    plateau,
    read_gauges,
    run_clients,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 600) -> float:
    """Seconds until ``/health`` answers 200 (raises if the server exits first)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


def wait_idle(metrics_url: str, timeout: float = 120) -> None:
    """Until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gauges = read_gauges(metrics_url, ("pagedtree:num_requests_running", "pagedtree:num_requests_waiting",
                                           "pagedtree:kv_cache_usage_perc"))
        if not any(gauges.values()):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the server did not go idle: {gauges}")


def run(args: argparse.Namespace) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    source = Path(args.source).resolve() if args.source else ROOT
    env = dict(os.environ, PYTHONPATH=str(source))
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    command = [sys.executable, "-m", "pagedtree.entrypoints.cli", "serve", "--model", args.model,
               "--device", "cpu", "--port", str(port), "--log-level", "warning",
               "--max-waiting-requests", "256", *shlex.split(args.server_args)]
    log = open(Path(args.out_dir) / f"{args.tag}.server.log", "w")
    process = subprocess.Popen(command, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready_seconds = wait_healthy(url, process)
        clients = SoakClients.parse(args.clients)
        sampler = MemorySampler(process.pid, args.interval, url + "/metrics")
        with sampler:
            with tqdm(total=int(args.duration), desc=f"soak {args.tag}", unit="s") as bar:
                async def tick() -> None:
                    started = time.monotonic()
                    while (done := time.monotonic() - started) < args.duration:
                        bar.n = int(done)
                        bar.set_postfix(rss=f"{sampler.samples[-1].rss / 2**20:.0f}MiB")
                        bar.refresh()
                        await asyncio.sleep(1.0)

                async def main():
                    counts, _ = await asyncio.gather(run_clients(url, clients, args.duration, seed=args.seed), tick())
                    return counts

                counts = asyncio.run(main())
            under_load = list(sampler.samples)
            wait_idle(url + "/metrics")
            time.sleep(3.0)  # past the idle trim
            idle = sampler.sample()
        fit = plateau(under_load, warm_up=args.warm_up)
        health = urllib.request.urlopen(url + "/health", timeout=10).status
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
    return {
        "tag": args.tag,
        "model": args.model,
        "server_args": args.server_args,
        "env": args.env,
        "source": str(source),
        "duration": args.duration,
        "ready_seconds": ready_seconds,
        "health_after": health,
        "counts": asdict(counts),
        "plateau": asdict(fit),
        "idle_rss_mb": idle.rss / 1e6,
        "warm_up": args.warm_up,
        "samples": [asdict(s) for s in sampler.samples],
    }


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_heap) = plt.subplots(1, 2, figsize=(13, 4.8))
    for result in results:
        ts = [s["t"] / 60 for s in result["samples"]]
        fit = result["plateau"]
        label = f"{result['tag']} (last third {fit['slope_mb_per_s']:+.3f} MB/s)"
        ax_rss.plot(ts, [s["rss"] / 2**20 for s in result["samples"]], label=label)
        in_use = [s["gauges"].get("pagedtree:malloc_bytes{state=in_use}") for s in result["samples"]]
        if any(v is not None for v in in_use):
            line, = ax_heap.plot(ts, [v / 2**20 if v is not None else float("nan") for v in in_use],
                                 label=f"{result['tag']}: in use")
            free = [s["gauges"].get("pagedtree:malloc_bytes{state=free}") for s in result["samples"]]
            ax_heap.plot(ts, [v / 2**20 if v is not None else float("nan") for v in free], linestyle="--",
                         color=line.get_color(), label=f"{result['tag']}: free")
    ax_rss.set(xlabel="minutes", ylabel="server RSS (MiB)", title="Server RSS under the soak's client mix")
    ax_heap.set(xlabel="minutes", ylabel="MiB", title="glibc heap (from /metrics)")
    ax_rss.legend(fontsize=8)
    if ax_heap.lines:
        ax_heap.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="served model (default: smollm2-135m-instruct)")
    parser.add_argument("--server-args", default="", help="more `pagedtree serve` arguments, e.g. '--spec-drafter suffix'")
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="environment of the server")
    parser.add_argument("--source", default=None, help="serve from this checkout instead (an earlier version)")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    parser.add_argument("--warm-up", type=float, default=120.0, help="seconds before the RSS baseline (default 120)")
    parser.add_argument("--clients", default="", help="loops per client kind and sizes (pagedtree.loadgen.soak.SoakClients), "
                                                      "e.g. valid=4,huge=1,long_max_words=300")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="benchmarks/results/soak")
    parser.add_argument("--tag", default="soak", help="file name stem of the outputs")
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON", help="only plot these results")
    parser.add_argument("--out", default=None, help="with --plot: the PNG to write")
    args = parser.parse_args()
    if args.plot:
        plot([json.loads(Path(p).read_text()) for p in args.plot], Path(args.out or Path(args.out_dir) / "rss.png"))
        return 0
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    result = run(args)
    out = Path(args.out_dir) / f"{args.tag}.json"
    out.write_text(json.dumps(result, indent=1))
    plot([result], Path(args.out_dir) / f"{args.tag}.png")
    fit = result["plateau"]
    print(json.dumps({"tag": args.tag, "ready_seconds": round(result["ready_seconds"], 1),
                      "rss_mb_after_warm_up": round(fit["start_mb"]), "rss_mb_end": round(fit["end_mb"]),
                      "rss_mb_peak": round(fit["peak_mb"]),
                      "rss_mb_idle_after": round(result["idle_rss_mb"]), "slope_last_third_mb_per_s": round(fit["slope_mb_per_s"], 4),
                      "counts": result["counts"]["by_kind"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
