"""Long-run load for a server's memory: mixed client kinds, RSS sampling, plateau figures.

A soak drives a running server (``pagedtree serve`` or anything speaking its
protocols) with several kinds of clients at once, each in its own loop:

- ``valid``: completions, chat, TGI, streamed or not, prompt lists, ``n=2``;
- ``disconnect``: a stream that the client drops after its first event;
- ``logprobs``: chat with ``n=8`` and ``top_logprobs=5``;
- ``hostile``: bodies the server must refuse (huge stop lists, deep JSON, wrong
  content types, oversized and broken bodies, client templates, lone surrogates,
  extreme floats);
- ``long``: distinct long prompts (new text every time: per-request suffix trees,
  prefix-cache misses, tokenizer work);
- ``huge``: a prompt of about a million characters that is too long for the context;
- ``structured``: constrained requests (JSON schemas from a family larger than one
  round's worth, so the grammar cache both hits and compiles; choices, regexes,
  ``required`` and named tool calls), streamed and not;
- ``grammar``: constraints the server must refuse (keywords it does not enforce,
  remote ``$ref``, negative counts, tools on completions) and slow-to-compile ones
  that the client abandons, so that the server kills their compiles;
- ``slowloris``: a connection that sends a header line a second and never finishes.

``MemorySampler`` records a process's RSS (and, when given a ``/metrics`` URL, the
server's own memory gauges) at a fixed interval; ``plateau`` fits the slope of the
last part of the run. ``python -m pagedtree.loadgen.soak --url URL --duration S`` runs
the clients alone (in a process of their own, so that their work does not compete
with an in-process server for the GIL) and prints the counts as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import socket
import string
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import aiohttp

CLIENT_KINDS = ("valid", "disconnect", "logprobs", "hostile", "long", "huge", "structured", "grammar", "slowloris")
# Gauges of pagedtree's /metrics that a soak records beside the RSS.
MEMORY_GAUGES = (
    "process_resident_memory_bytes",
    "pagedtree:malloc_bytes",
    "pagedtree:python_allocated_blocks",
    "pagedtree:suffix_tree_nodes",
    "pagedtree:kv_cache_usage_perc",
    "pagedtree:malloc_trims_total",
    "pagedtree:grammar_cache_bytes",
    "pagedtree:grammar_worker_rss_bytes",
)
_WORDS = ("alpha beta gamma delta query index table select join where group order limit value record "
          "stream buffer cache thread socket parse token model layer vector matrix kernel tensor block "
          "paged tree draft verify accept reject commit sample logits prefix suffix engine server").split()


@dataclass
class SoakClients:
    """How many concurrent loops of each client kind run (0: none)."""

    valid: int = 4
    disconnect: int = 2
    logprobs: int = 1
    hostile: int = 2
    long: int = 1
    huge: int = 0
    structured: int = 1
    grammar: int = 1
    slowloris: int = 2
    max_tokens: int = 24  # upper bound of a valid request's max_tokens
    long_min_words: int = 200  # a long prompt's length in words, drawn in [min, max]
    long_max_words: int = 600
    huge_chars: int = 1_000_000

    @classmethod
    def parse(cls, text: str) -> SoakClients:
        """``"valid=4,disconnect=2,long_max_words=300"``: loops per kind and sizes
        (anything left out keeps its default)."""
        out = cls()
        names = [f.name for f in dataclasses.fields(cls)]
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            if key not in names:
                raise ValueError(f"unknown soak client setting {key!r}; settings: {', '.join(names)}")
            setattr(out, key, int(value))
        return out


@dataclass
class SoakCounts:
    """What the clients saw: responses by kind and status, connection errors."""

    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, kind: str, outcome: str | int, count: int = 1) -> None:
        """Count an outcome (an HTTP status, or a word such as ``dropped``)."""
        counts = self.by_kind.setdefault(kind, {})
        counts[str(outcome)] = counts.get(str(outcome), 0) + count

    def merge(self, other: SoakCounts) -> None:
        """Add another run's counts to these."""
        for kind, by_outcome in other.by_kind.items():
            counts = self.by_kind.setdefault(kind, {})
            for outcome, count in by_outcome.items():
                counts[outcome] = counts.get(outcome, 0) + count

    def total(self, outcome: str | int) -> int:
        """The outcome's count over every kind."""
        return sum(c.get(str(outcome), 0) for c in self.by_kind.values())


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


async def _valid(session: aiohttp.ClientSession, url: str, rng: random.Random, cfg: SoakClients,
                 counts: SoakCounts) -> None:
    kind = rng.choice(["stream", "plain", "chat", "chat_stream", "tgi", "tgi_stream", "list", "n2"])
    max_tokens = rng.randint(1, cfg.max_tokens)
    if kind in ("stream", "plain", "list", "n2"):
        body = {"prompt": [_words(rng, 3), _words(rng, 5)] if kind == "list" else _words(rng, rng.randint(1, 20)),
                "max_tokens": max_tokens, "stream": kind == "stream", "temperature": rng.choice([0, 0.8]),
                "n": 2 if kind == "n2" else 1, "stop": ["xyz"] * rng.randint(0, 4)}
        path = "/v1/completions"
    elif kind in ("chat", "chat_stream"):
        body = {"messages": [{"role": "user", "content": _words(rng, rng.randint(1, 10))}],
                "max_tokens": max_tokens, "stream": kind == "chat_stream"}
        path = "/v1/chat/completions"
    else:
        body = {"inputs": _words(rng, 4), "parameters": {"max_new_tokens": max_tokens, "do_sample": rng.random() < 0.5}}
        path = "/generate_stream" if kind == "tgi_stream" else "/generate"
    async with session.post(url + path, json=body) as r:
        await r.read()
        counts.add("valid", r.status)


async def _disconnect(session: aiohttp.ClientSession, url: str, rng: random.Random, cfg: SoakClients,
                      counts: SoakCounts) -> None:
    if rng.random() < 0.5:
        body = {"prompt": _words(rng, 8), "max_tokens": 64, "ignore_eos": True, "stream": True}
        path = "/v1/completions"
    else:
        body = {"inputs": _words(rng, 8), "parameters": {"max_new_tokens": 64}}
        path = "/generate_stream"
    async with session.post(url + path, json=body) as r:
        await r.content.readline()  # the first event, then leave: the server must abort
        r.close()
        counts.add("disconnect", "dropped" if r.status == 200 else r.status)


async def _logprobs(session: aiohttp.ClientSession, url: str, rng: random.Random, cfg: SoakClients,
                    counts: SoakCounts) -> None:
    body = {"messages": [{"role": "user", "content": _words(rng, 12)}], "n": 8, "logprobs": True,
            "top_logprobs": 5, "max_tokens": rng.randint(4, cfg.max_tokens), "temperature": 0.9,
            "stream": rng.random() < 0.5}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        await r.read()
        counts.add("logprobs", r.status)


def _hostile_body(rng: random.Random) -> tuple[str, bytes, str]:
    kind = rng.choice(["stops", "deep", "text_plain", "too_big", "bad_json", "template", "surrogate",
                       "floats", "seed", "ids"])
    path, content_type = "/v1/completions", "application/json"
    if kind == "stops":
        data = json.dumps({"prompt": "Hi", "stop": ["x" * 1500] * 2000}).encode()
    elif kind == "deep":
        data = b"[" * 50_000
    elif kind == "text_plain":
        data, content_type = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(), "text/plain"
    elif kind == "too_big":
        data = b'{"prompt": "' + b"a" * 2_500_000 + b'"}'
    elif kind == "bad_json":
        data = b'{"prompt": "Hi", "max_tokens": '
    elif kind == "template":
        path = "/v1/chat/completions"
        data = json.dumps({"messages": [{"role": "user", "content": "x"}],
                           "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}}).encode()
    elif kind == "surrogate":
        path = rng.choice(["/v1/completions", "/generate", "/v1/chat/completions"])
        text = "Hi \ud800 there"
        body = ({"prompt": text} if path == "/v1/completions" else {"inputs": text} if path == "/generate"
                else {"messages": [{"role": "user", "content": text}]})
        data = json.dumps(body).encode()
    elif kind == "floats":
        data = json.dumps({"prompt": "Hi", "max_tokens": 3, "temperature": rng.choice([1e-300, 1e300, 0.8]),
                           "top_p": rng.choice([1e-300, 1.0]), "repetition_penalty": rng.choice([1e-300, 1e300]),
                           "min_p": rng.choice([0.0, 1.0])}).encode()
    elif kind == "seed":
        data = json.dumps({"prompt": "Hi", "n": 2, "max_tokens": 3, "seed": 2**70}).encode()
    else:
        data = json.dumps({"prompt": [10**9, -1], "max_tokens": 2}).encode()
    return path, data, content_type


async def _hostile(session: aiohttp.ClientSession, url: str, rng: random.Random, cfg: SoakClients,
                   counts: SoakCounts) -> None:
    path, data, content_type = _hostile_body(rng)
    async with session.post(url + path, data=data, headers={"Content-Type": content_type}) as r:
        await r.read()
        counts.add("hostile", r.status)


async def _long(session: aiohttp.ClientSession, url: str, rng: random.Random, cfg: SoakClients,
                counts: SoakCounts) -> None:
    # New text every time: random words with a random number in each line.
    low, high = cfg.long_min_words, cfg.long_max_words
    lines = [f"{rng.randrange(10**6)} {_words(rng, 12)}" for _ in range(rng.randint(low, high) // 13 + 1)]
    body = {"prompt": "\n".join(lines), "max_tokens": rng.randint(8, 2 * cfg.max_tokens), "temperature": 0,
            "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        await r.read()
        counts.add("long", r.status)


async def _huge(session: aiohttp.ClientSession, url: str, rng: random.Random, cfg: SoakClients,
                counts: SoakCounts) -> None:
    text = "".join(rng.choice(string.ascii_lowercase + "      ") for _ in range(cfg.huge_chars))
    async with session.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 2}) as r:
        await r.read()
        counts.add("huge", r.status)


# Distinct schemas the ``structured`` client draws from: more than a round compiles,
# so that the cache keeps both hitting and compiling.
SCHEMA_FAMILY = 64
# A constraint whose compile takes far longer than the ``grammar`` client waits.
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 2000)) + ")"


def _schema(rng: random.Random) -> dict:
    member = rng.randrange(SCHEMA_FAMILY)
    return {"type": "object", "additionalProperties": False, "required": [f"k{member}"],
            "properties": {f"k{member}": {"type": "integer", "minimum": 0, "maximum": 999},
                           "note": {"type": "string", "maxLength": 8}}}


async def _structured(session: aiohttp.ClientSession, url: str, rng: random.Random, cfg: SoakClients,
                      counts: SoakCounts) -> None:
    kind = rng.choice(["schema", "choice", "regex", "required_tool", "named_tool"])
    stream = rng.random() < 0.5
    body: dict = {"messages": [{"role": "user", "content": _words(rng, 6)}], "stream": stream,
                  "max_tokens": rng.randint(4, 2 * cfg.max_tokens), "temperature": rng.choice([0, 0.8])}
    if kind == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "item", "schema": _schema(rng)}}
    elif kind == "choice":
        body["guided_choice"] = [_words(rng, 2) for _ in range(rng.randint(2, 5))]
    elif kind == "regex":
        body["guided_regex"] = f"[a-z]{{1,{rng.randint(2, 12)}}}( [a-z]+)?"
    else:
        tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": _schema(rng)}} for i in range(2)]
        body["tools"] = tools
        body["tool_choice"] = ("required" if kind == "required_tool"
                               else {"type": "function", "function": {"name": "tool_1"}})
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        await r.read()
        counts.add("structured", r.status)


def _refused_constraint(rng: random.Random) -> tuple[str, dict]:
    choice = rng.choice(["not", "remote_ref", "negative", "unholdable", "tools_on_completions", "ref_cycle"])
    schema: dict
    if choice == "not":
        schema = {"not": {"type": "string"}}
    elif choice == "remote_ref":
        schema = {"$ref": rng.choice(["http://169.254.169.254/latest/meta-data", "file:///etc/passwd"])}
    elif choice == "negative":
        schema = {"type": "array", "minItems": -rng.randint(1, 99)}
    elif choice == "unholdable":
        schema = {"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False}
    elif choice == "ref_cycle":
        schema = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    else:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        return "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "tools": [tool], "tool_choice": "required"}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                    "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                              "schema": schema}}}


async def _grammar(session: aiohttp.ClientSession, url: str, rng: random.Random, cfg: SoakClients,
                   counts: SoakCounts) -> None:
    if rng.random() < 0.8:
        path, body = _refused_constraint(rng)
        async with session.post(url + path, json=body) as r:
            await r.read()
            counts.add("grammar", r.status)
        return
    # A slow compile, distinct every time (never cached), that the client gives up on.
    body = {"prompt": "Hi", "max_tokens": 2, "guided_regex": f"{SLOW_REGEX}|{rng.randrange(10**9)}"}
    try:
        async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            await r.read()
            counts.add("grammar", r.status)
    except asyncio.TimeoutError:
        counts.add("grammar", "abandoned")


_CLIENTS = {"valid": _valid, "disconnect": _disconnect, "logprobs": _logprobs, "hostile": _hostile,
            "long": _long, "huge": _huge, "structured": _structured, "grammar": _grammar}


def _slowloris(host: str, port: int, until: float, counts: SoakCounts, lock: threading.Lock) -> None:
    while time.monotonic() < until:
        try:
            with socket.create_connection((host, port), timeout=30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                while time.monotonic() < until:
                    time.sleep(1.0)
                    s.sendall(b"X-Slow: 1\r\n")
        except OSError:
            with lock:
                counts.add("slowloris", "cut_off")  # closed by the server: good


async def run_clients(url: str, clients: SoakClients, duration: float | None = None,
                      requests_per_loop: int | None = None, seed: int = 0) -> SoakCounts:
    """Run every client loop against ``url`` until ``duration`` seconds have passed,
    or until each loop has sent ``requests_per_loop`` requests (identical rounds: the
    same seed gives the same requests); returns what they saw."""
    if (duration is None) == (requests_per_loop is None):
        raise ValueError("give exactly one of duration and requests_per_loop")
    counts = SoakCounts()
    lock = threading.Lock()
    until = time.monotonic() + (duration if duration is not None else 10**9)

    async def loop(kind: str, index: int) -> None:
        rng = random.Random(f"{seed}:{kind}:{index}")
        sent = 0
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < until and (requests_per_loop is None or sent < requests_per_loop):
                sent += 1
                try:
                    await _CLIENTS[kind](session, url, rng, clients, counts)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    counts.add(kind, "connection_error")

    host, port = _host_port(url)
    slow_until = until if duration is not None else time.monotonic() + 5.0
    slow = [asyncio.get_running_loop().run_in_executor(None, _slowloris, host, port, slow_until, counts, lock)
            for _ in range(clients.slowloris)]
    await asyncio.gather(*(loop(kind, i) for kind in _CLIENTS for i in range(getattr(clients, kind))))
    await asyncio.gather(*slow)
    return counts


def _host_port(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    return host or "127.0.0.1", int(port)


# ------------------------------------------------------------------ memory
def rss_bytes(pid: int) -> int:
    """A process's resident set size (``VmRSS``), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def read_gauges(metrics_url: str, names: Sequence[str] = MEMORY_GAUGES) -> dict[str, float]:
    """The named series of a Prometheus text page, keyed ``name`` or ``name{label=value}``
    by their labels other than ``model_name``."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        if name not in names:
            continue
        kept = [item for item in labels.rstrip("}").split(",") if item and not item.startswith("model_name=")]
        key = name + ("{" + ",".join(item.replace('"', "") for item in kept) + "}" if kept else "")
        out[key] = float(value)
    return out


@dataclass
class MemorySample:
    """One reading: seconds since the start, RSS bytes, and the server's gauges."""

    t: float
    rss: int
    gauges: dict[str, float] = field(default_factory=dict)


class MemorySampler:
    """Reads a process's RSS (and its /metrics gauges) every ``interval`` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 10.0, metrics_url: str | None = None):
        self.pid = pid
        self.interval = interval
        self.metrics_url = metrics_url
        self.samples: list[MemorySample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._started = time.monotonic()

    def sample(self) -> MemorySample:
        """Take one reading now (also kept in ``samples``)."""
        gauges = {}
        if self.metrics_url is not None:
            try:
                gauges = read_gauges(self.metrics_url)
            except OSError:
                gauges = {}
        reading = MemorySample(time.monotonic() - self._started, rss_bytes(self.pid), gauges)
        self.samples.append(reading)
        return reading

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except (OSError, RuntimeError):
                return  # the process is gone

    def __enter__(self) -> MemorySampler:
        self._started = time.monotonic()
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.interval + 5)


@dataclass
class Plateau:
    """How RSS moved: the start of the measured part, the end, the peak, and the
    least-squares slope of the last ``fraction`` of the samples (MB/s)."""

    start_mb: float
    end_mb: float
    peak_mb: float
    slope_mb_per_s: float
    last_part_seconds: float


def plateau(samples: Sequence[MemorySample], warm_up: float = 0.0, fraction: float = 1 / 3) -> Plateau:
    """Fit the RSS of ``samples`` after ``warm_up`` seconds (see ``Plateau``)."""
    kept = [s for s in samples if s.t >= warm_up] or list(samples)
    tail = kept[int(len(kept) * (1 - fraction)):] if len(kept) >= 3 else kept
    ts = [s.t for s in tail]
    ys = [s.rss / 1e6 for s in tail]
    mean_t, mean_y = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mean_t) ** 2 for t in ts)
    slope = sum((t - mean_t) * (y - mean_y) for t, y in zip(ts, ys)) / var if var > 0 else 0.0
    return Plateau(kept[0].rss / 1e6, kept[-1].rss / 1e6, max(s.rss for s in kept) / 1e6, slope,
                   ts[-1] - ts[0] if ts else 0.0)


@dataclass
class IdleReading:
    """The server's memory at a quiet moment: after a round of load, once every request
    has ended and the engine has trimmed its heap."""

    round: int
    rss: int
    python_blocks: float
    heap_in_use: float | None
    suffix_nodes: float


def wait_idle(metrics_url: str, timeout: float = 120.0) -> None:
    """Until no request runs or waits and every KV block is free (from ``/metrics``)."""
    deadline = time.monotonic() + timeout
    names = ("pagedtree:num_requests_running", "pagedtree:num_requests_waiting", "pagedtree:kv_cache_usage_perc")
    while True:
        gauges = read_gauges(metrics_url, names)
        if len(gauges) == len(names) and not any(gauges.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not go idle: {gauges}")
        time.sleep(0.2)


def soak_rounds(url: str, pid: int, clients: SoakClients, rounds: int, round_seconds: float,
                settle_seconds: float = 2.0, seed: int = 0) -> tuple[list[IdleReading], SoakCounts]:
    """``rounds`` rounds of ``round_seconds`` of load, each followed by a reading once
    the server is idle (``settle_seconds`` after, past its idle heap trim). Readings at
    idle moments do not see requests in flight, so a per-request leak shows as growth
    from round to round however small the load's own noise."""
    readings = []
    total = SoakCounts()
    for index in range(rounds):
        counts = asyncio.run(run_clients(url, clients, round_seconds, seed=seed * 1000 + index))
        total.merge(counts)
        wait_idle(url + "/metrics")
        time.sleep(settle_seconds)
        gauges = read_gauges(url + "/metrics")
        readings.append(IdleReading(
            index, rss_bytes(pid), gauges.get("pagedtree:python_allocated_blocks", 0.0),
            gauges.get("pagedtree:malloc_bytes{state=in_use}"),
            sum(v for k, v in gauges.items() if k.startswith("pagedtree:suffix_tree_nodes")),
        ))
    return readings, total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedtree.loadgen.soak",
        description="Run the soak's client mix against a server and print what the clients saw as JSON.")
    parser.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--duration", type=float, default=None, help="seconds to run")
    parser.add_argument("--requests-per-loop", type=int, default=None,
                        help="instead of a duration: requests each client loop sends (identical rounds)")
    parser.add_argument("--clients", default="", help=f"loops per kind, e.g. valid=4,huge=1 (kinds: {', '.join(CLIENT_KINDS)})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the requests (same seed, same requests)")
    args = parser.parse_args(argv)
    counts = asyncio.run(run_clients(args.url, SoakClients.parse(args.clients), args.duration,
                                     args.requests_per_loop, args.seed))
    json.dump(asdict(counts), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
