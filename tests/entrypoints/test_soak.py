"""Soak: a real ``pagedtree serve`` process under the soak's client mix, memory watched.

The clients (``pagedtree.loadgen.soak``) run side by side: completions, chat and TGI,
streamed and not, disconnects mid-stream, ``n=8`` logprob chats, hostile bodies
(huge stop lists, deep JSON, wrong content types, oversized bodies, client
templates, lone surrogates, extreme floats), distinct long prompts, constrained
requests (schemas, choices, regexes, tool calls), constraints the server must refuse
and slow compiles abandoned by their clients, slowloris.

- ``test_a_short_soak_serves_the_mix`` (slow, about 15 s): two short rounds
  of the mix against a real server: every valid request served, every hostile one
  refused with a 4xx, no 500, the server healthy and stopping cleanly afterwards.
- ``test_fast_soak_leaves_memory_flat`` (slow, about 90 s): rounds of load,
  each followed by a reading at an idle moment (every request ended, the heap
  trimmed). After two warm-up rounds the server's Python blocks may grow by at most
  ``BLOCKS_PER_REQUEST`` per request served, and from the first reading on its RSS
  by at most ``FAST_RSS_GROWTH``.
- ``test_the_fast_soak_catches_planted_leaks`` (slow): the same soak against a server
  that keeps each finished request's detokenizer, and against one with oneDNN's
  unbounded primitive caches; both must fail the criteria (a test that can fail).
- ``test_thirty_minute_soak`` (slow, plain and with the suffix drafter): six rounds of
  five minutes of the full mix (with a 900,000-character prompt at a time) on
  SmolLM2-135M; every idle reading after the warm-up rounds within ``LONG_RSS_GROWTH``
  of the RSS and ``LONG_HEAP_GROWTH`` of the heap in use read before them; no 500,
  the engine alive afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

from pagedtree.loadgen.soak import (
    IdleReading,
    SoakClients,
    SoakCounts,
    soak_rounds,
)
from tests.entrypoints.test_serve_cli import ROOT, free_port, http, wait_healthy

# Idle readings of a clean server grew by 0.4-1.2 Python blocks per request (caches
# that fill: token texts, aiohttp's and the re module's); a leak of one small
# object with a dict or a list per request is more than this.
BLOCKS_PER_REQUEST = 3.0
FAST_RSS_GROWTH = 24 * 2**20
WARM_ROUNDS = 2
# The thirty-minute soak (docs/serving.md, "Server memory"): idle readings after the warm-up
# rounds within these of the one before them. Under load the RSS swings by a few
# hundred MiB of free heap that the idle trim hands back, so it is read at idle.
LONG_ROUNDS = 6
LONG_RSS_GROWTH = 0.05
LONG_HEAP_GROWTH = 64 * 2**20
THIRTY_MINUTES = float(os.environ.get("PAGEDTREE_SOAK_SECONDS", "1800"))

# A per-request leak planted for the mutation check: every finished request's
# detokenizer is kept (as a forgotten ``release`` would).
PLANT_DETOKENIZER_LEAK = """
from pagedtree.engine.output_processor import OutputProcessor
kept = []
real_release = OutputProcessor.release
def leaky_release(self, request_id):
    kept.append(self._detokenizers.get(request_id))
    real_release(self, request_id)
OutputProcessor.release = leaky_release
"""


@dataclass
class Served:
    """A ``pagedtree serve`` process on a loopback port."""

    process: subprocess.Popen
    url: str


def serve(model: str, *args: str, plant: str = "", env: dict[str, str] | None = None) -> Served:
    """Start ``pagedtree serve`` (with ``plant`` run first in its interpreter) and wait
    until it is healthy."""
    port = free_port()
    argv = ["serve", "--model", model, "--device", "cpu", "--port", str(port), "--max-waiting-requests", "256",
            "--keepalive-timeout", "3", "--log-level", "warning", *args]
    code = f"{plant}\nimport sys\nfrom pagedtree.entrypoints.cli import main\nsys.exit(main({argv!r}))"
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, **(env or {})),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
    except BaseException:
        process.kill()
        raise
    return Served(process, url)


def stop(served: Served) -> str:
    """SIGTERM, then the server's stderr (it must exit 0 on its own)."""
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGTERM)
    try:
        _, stderr = served.process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        served.process.kill()
        _, stderr = served.process.communicate()
        raise AssertionError("the server did not exit within 60 s of SIGTERM")
    assert served.process.returncode == 0, stderr[-3000:]
    return stderr


def fast_soak(model: str, *args: str, plant: str = "", env: dict[str, str] | None = None,
              rounds: int = 6, round_seconds: float = 11.0) -> tuple[list[IdleReading], SoakCounts]:
    """The fast soak's readings and counts (the server stopped afterwards)."""
    served = serve(model, *args, plant=plant, env=env)
    try:
        clients = SoakClients(valid=3, disconnect=2, logprobs=1, hostile=2, long=1, huge=0, structured=1, grammar=1,
                              slowloris=1, max_tokens=16, long_min_words=30, long_max_words=80)
        readings, counts = soak_rounds(served.url, served.process.pid, clients, rounds, round_seconds)
        assert http(served.url + "/health")[0] == 200
    finally:
        stop(served)
    return readings, counts


def check_constrained(counts: SoakCounts) -> None:
    """Every valid constrained request served; every bad constraint a 400, or given up
    on by its client while its slow compile ran."""
    structured, grammar = counts.by_kind.get("structured", {}), counts.by_kind.get("grammar", {})
    assert structured.get("200", 0) > 0 and set(structured) == {"200"}, counts
    assert grammar.get("400", 0) > 0 and set(grammar) <= {"400", "abandoned"}, counts


def flat(readings: list[IdleReading], counts: SoakCounts) -> tuple[bool, str]:
    """Whether memory stayed flat after the warm-up rounds, and the figures."""
    first, last = readings[WARM_ROUNDS], readings[-1]
    served = sum(n for kind, by in counts.by_kind.items() if kind not in ("hostile", "grammar") for n in by.values())
    per_round = served / len(readings)
    blocks = (last.python_blocks - first.python_blocks) / (per_round * (len(readings) - 1 - WARM_ROUNDS))
    # RSS from the first reading: a cache that fills within a few rounds and then
    # stays (oneDNN's, unbounded: +400 MiB in three rounds) is caught too.
    rss = last.rss - readings[0].rss
    figures = (f"{blocks:.2f} Python blocks per request (bound {BLOCKS_PER_REQUEST}), RSS {rss / 2**20:+.1f} MiB "
               f"(bound {FAST_RSS_GROWTH >> 20}); readings {[(r.rss >> 20, int(r.python_blocks)) for r in readings]}")
    return blocks <= BLOCKS_PER_REQUEST and rss <= FAST_RSS_GROWTH, figures


@pytest.mark.slow
def test_a_short_soak_serves_the_mix(chat_model_path):
    readings, counts = fast_soak(str(chat_model_path), "--max-model-len", "512", "--block-size", "4",
                                 rounds=2, round_seconds=3.0)
    assert len(readings) == 2
    assert counts.total(200) > 10 and counts.total(400) > 2 and counts.total(500) == 0, counts
    check_constrained(counts)


@pytest.mark.slow
def test_fast_soak_leaves_memory_flat(chat_model_path):
    readings, counts = fast_soak(str(chat_model_path), "--max-model-len", "512", "--block-size", "4")
    assert counts.total(200) > 100 and counts.total(400) > 10 and counts.total(500) == 0, counts
    check_constrained(counts)
    ok, figures = flat(readings, counts)
    print(counts.by_kind, figures)
    assert ok, figures


@pytest.mark.slow
@pytest.mark.parametrize("plant, env", [
    (PLANT_DETOKENIZER_LEAK, {}),
    ("", {"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}),
], ids=["python-per-request-leak", "unbounded-onednn-caches"])
def test_the_fast_soak_catches_planted_leaks(chat_model_path, plant, env):
    readings, counts = fast_soak(str(chat_model_path), "--max-model-len", "512", "--block-size", "4",
                                 plant=plant, env=env)
    ok, figures = flat(readings, counts)
    print(figures)
    assert not ok, f"the planted leak went unnoticed: {figures}"


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["plain", "suffix"])
def test_thirty_minute_soak(drafter):
    from pagedtree.loading import packaged_models as pm

    if not pm.is_installed(pm.SMOLLM2_135M):
        pytest.skip(f"{pm.SMOLLM2_135M.name} not installed: {pm.install_command(pm.SMOLLM2_135M)}")
    args = ["--spec-drafter", "suffix"] if drafter == "suffix" else []
    served = serve("smollm2-135m-instruct", *args)
    try:
        readings, counts = soak_rounds(served.url, served.process.pid, SoakClients(huge=1), LONG_ROUNDS,
                                       THIRTY_MINUTES / LONG_ROUNDS)
        assert http(served.url + "/health")[0] == 200
    finally:
        stop(served)
    base, rest = readings[WARM_ROUNDS - 1], readings[WARM_ROUNDS:]
    figures = (f"{drafter}: {counts.by_kind}; idle readings (RSS MiB, heap in use MiB): "
               f"{[(r.rss >> 20, int(r.heap_in_use or 0) >> 20) for r in readings]}")
    print(figures)
    assert counts.total(500) == 0 and counts.total(200) > 100, figures
    check_constrained(counts)
    assert max(r.rss for r in rest) <= base.rss * (1 + LONG_RSS_GROWTH), figures
    if base.heap_in_use is not None:
        assert max(r.heap_in_use for r in rest) <= base.heap_in_use + LONG_HEAP_GROWTH, figures
