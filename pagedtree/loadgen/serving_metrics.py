"""Serving metrics from per-request timestamps: pure functions and plain data, no I/O.

Definitions (vLLM's ``benchmark_serving``), per successful request, all times from
``time.perf_counter()`` in seconds; summaries report milliseconds:

* **TTFT** (time to first token) = arrival of the first content chunk - send time.
* **E2EL** (end-to-end latency) = ``end_time`` - send time. The backends set
  ``end_time`` to the arrival of the last content chunk (as vLLM does), so a
  trailing usage chunk or ``[DONE]`` does not count.
* **TPOT** (time per output token, first token excluded) =
  (E2EL - TTFT) / (output_tokens - 1); defined only for requests with more than
  one output token (others are left out of the TPOT statistics).
* **ITL** (inter-token latency) = the gaps between consecutive content chunks,
  pooled over all requests. A chunk is one SSE event carrying output (an
  OpenAI chunk with a non-empty ``choices``, a TGI ``token`` event). When one
  chunk carries several tokens (a speculative step, a server that batches its
  writes) the gap is still the chunk gap, not divided by the tokens, so ITL then
  differs from TPOT; several events read in one network read get the same
  timestamp, which gives gaps of 0.
* **Goodput** = successful requests per second that meet every given SLO
  (``ttft``, ``tpot``, ``e2el`` in ms). A request with at most one output token
  has no TPOT and passes a TPOT SLO (vLLM counts its TPOT as 0).

Failed requests are counted (``failed``) but left out of every latency statistic
and of the token totals. A statistic over no values (no successful request, no
request with two tokens, ...) is ``None`` (``null`` in JSON), never NaN; so is a
throughput when the duration is not positive.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it; times are ``time.perf_counter()`` seconds.

    ``chunk_times`` holds the arrival time of every content chunk, the first one
    being the first-token time. ``output_tokens`` is the server's count (OpenAI
    ``usage.completion_tokens``, TGI ``details.generated_tokens``) when it sent
    one, else a count made by the client; ``output_tokens_source`` says which
    (``usage``, ``details``, ``tokenizer`` or ``chunks``).
    """

    prompt_tokens: int | None = None
    expected_output_tokens: int | None = None
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    output_tokens: int = 0
    output_tokens_source: str = "chunks"
    success: bool = False
    error: str = ""
    generated_text: str = ""

    @property
    def first_token_time(self) -> float | None:
        """Arrival time of the first content chunk (None when none came)."""
        return self.chunk_times[0] if self.chunk_times else None

    def to_dict(self) -> dict[str, Any]:
        """The record and its derived latencies (seconds), JSON-ready."""
        return {
            "success": self.success,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "expected_output_tokens": self.expected_output_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_source": self.output_tokens_source,
            "send_time": self.send_time,
            "first_token_time": self.first_token_time,
            "end_time": self.end_time,
            "chunk_times": list(self.chunk_times),
            "ttft_s": ttft(self),
            "tpot_s": tpot(self),
            "e2el_s": e2el(self),
            "generated_text": self.generated_text,
        }


# ------------------------------------------------------------ per request
def ttft(record: RequestRecord) -> float | None:
    """Time to first token in seconds, or None without a content chunk."""
    first = record.first_token_time
    return None if first is None else first - record.send_time


def e2el(record: RequestRecord) -> float | None:
    """End-to-end latency in seconds, or None without an end time."""
    return None if record.end_time is None else record.end_time - record.send_time


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first, in seconds; None for <= 1 output token."""
    first, total = ttft(record), e2el(record)
    if record.output_tokens <= 1 or first is None or total is None:
        return None
    return (total - first) / (record.output_tokens - 1)


def itls(record: RequestRecord) -> list[float]:
    """Gaps between consecutive content chunks in seconds (one fewer than the chunks)."""
    times = record.chunk_times
    return [later - earlier for earlier, later in zip(times, times[1:])]


# ------------------------------------------------------------------ SLOs
def parse_slos(specs: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "e2el:2000"]`` as ``{"ttft": 500.0, "e2el": 2000.0}`` (milliseconds).

    Raises ``ValueError`` on an unknown key, a repeated key, or a value that is not
    a non-negative number.
    """
    slos: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"goodput SLO {spec!r} must be KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        if key in slos:
            raise ValueError(f"goodput SLO {key!r} is given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0 or ms == float("inf"):  # also rejects NaN
            raise ValueError(f"goodput SLO {spec!r} must be a finite number >= 0")
        slos[key] = ms
    return slos


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful request meets every SLO (a failed one never does)."""
    if not record.success:
        return False
    for key, limit in slos_ms.items():
        if key == "ttft":
            value = ttft(record)
        elif key == "e2el":
            value = e2el(record)
        elif key == "tpot":
            # No TPOT with <= 1 output token: nothing to miss (vLLM counts 0).
            value = tpot(record) if record.output_tokens > 1 else 0.0
        else:
            raise ValueError(f"unknown SLO {key!r}")
        if value is None or value * 1000.0 > limit:
            return False
    return True


# ------------------------------------------------------------- summaries
@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, p90, p99 and (population) standard deviation in ms; None when empty."""

    count: int
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    std: float | None = None

    @classmethod
    def from_seconds(cls, values: Sequence[float]) -> LatencyStats:
        """Statistics of ``values`` (seconds), reported in milliseconds."""
        if len(values) == 0:
            return cls(count=0)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        # numpy's default linear interpolation between order statistics, as vLLM.
        p50, p90, p99 = (float(p) for p in np.percentile(ms, PERCENTILES))
        return cls(count=len(ms), mean=float(ms.mean()), median=p50, p90=p90, p99=p99, std=float(ms.std()))


@dataclass(frozen=True)
class Summary:
    """A benchmark run's totals, throughputs and latency statistics."""

    completed: int
    failed: int
    total: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float | None
    output_throughput: float | None
    total_token_throughput: float | None
    goodput: float | None
    goodput_slos_ms: dict[str, float]
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-ready, with vLLM's key names (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "total_requests": self.total,
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "goodput": self.goodput,
            "goodput_slos_ms": dict(self.goodput_slos_ms),
        }
        for name in METRICS:
            stats: LatencyStats = getattr(self, name)
            for stat in ("mean", "median", "p90", "p99", "std"):
                out[f"{stat}_{name}_ms"] = getattr(stats, stat)
            out[f"num_{name}_samples"] = stats.count
        return out


def summary_keys() -> list[str]:
    """Every key of ``Summary.as_dict()`` (for checks and table layouts)."""
    empty = summarize([], 0.0)
    return list(empty.as_dict())


def _rate(count: float, duration_s: float) -> float | None:
    return count / duration_s if duration_s > 0 else None


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slos_ms: Mapping[str, float] | None = None) -> Summary:
    """The summary of a run of ``records`` that took ``duration_s`` seconds.

    Token totals count successful requests only; a prompt length nobody knows
    (``prompt_tokens`` None: no tokenizer and no server count) counts as 0.
    ``goodput`` is None unless ``slos_ms`` names at least one SLO.
    """
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    slos = dict(slos_ms or {})
    goodput = _rate(sum(meets_slos(r, slos) for r in ok), duration_s) if slos else None
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        total=len(records),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=_rate(len(ok), duration_s),
        output_throughput=_rate(output_tokens, duration_s),
        total_token_throughput=_rate(input_tokens + output_tokens, duration_s),
        goodput=goodput,
        goodput_slos_ms=slos,
        ttft=LatencyStats.from_seconds([v for r in ok if (v := ttft(r)) is not None]),
        tpot=LatencyStats.from_seconds([v for r in ok if (v := tpot(r)) is not None]),
        itl=LatencyStats.from_seconds([gap for r in ok for gap in itls(r)]),
        e2el=LatencyStats.from_seconds([v for r in ok if (v := e2el(r)) is not None]),
    )
