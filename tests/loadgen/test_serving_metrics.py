"""Serving metric definitions on synthetic timestamps."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedtree.loadgen.serving_metrics import (
    LatencyStats,
    RequestRecord,
    e2el,
    itls,
    meets_slos,
    parse_slos,
    summarize,
    summary_keys,
    tpot,
    ttft,
)


def record(send: float, chunks: list[float], tokens: int | None = None, prompt: int = 10,
           success: bool = True, end: float | None = None) -> RequestRecord:
    """A request sent at ``send`` whose content chunks came at ``chunks`` (one token each by default)."""
    return RequestRecord(
        prompt_tokens=prompt, send_time=send, chunk_times=list(chunks),
        end_time=(chunks[-1] if chunks else None) if end is None else end,
        output_tokens=len(chunks) if tokens is None else tokens, success=success,
    )


def test_per_request_definitions():
    r = record(10.0, [10.2, 10.3, 10.5, 10.6])
    assert ttft(r) == pytest.approx(0.2)
    assert e2el(r) == pytest.approx(0.6)
    # The first token is excluded: (0.6 - 0.2) / (4 - 1).
    assert tpot(r) == pytest.approx(0.4 / 3)
    assert itls(r) == pytest.approx([0.1, 0.2, 0.1])
    assert r.first_token_time == 10.2


def test_multi_token_chunks_itl_is_the_chunk_gap_tpot_uses_tokens():
    # Two chunks carrying 6 tokens: one ITL sample of the chunk gap, TPOT per token.
    r = record(0.0, [0.1, 0.4], tokens=6)
    assert itls(r) == pytest.approx([0.3])
    assert tpot(r) == pytest.approx(0.3 / 5)


def test_single_token_has_no_tpot_and_no_itl():
    r = record(0.0, [0.25])
    assert tpot(r) is None and itls(r) == []
    assert ttft(r) == e2el(r) == pytest.approx(0.25)


def test_no_chunk_no_ttft():
    r = RequestRecord(send_time=1.0, success=False, error="boom")
    assert ttft(r) is None and e2el(r) is None and tpot(r) is None and itls(r) == []


def test_summary_counts_failures_but_excludes_them_from_latencies_and_tokens():
    good = [record(0.0, [0.1, 0.2, 0.3]), record(0.0, [0.2, 0.3, 0.5], prompt=20)]
    # A failed request with a partial stream and absurd timings must not move any statistic.
    bad = record(0.0, [50.0, 99.0], success=False)
    s = summarize(good + [bad], duration_s=2.0)
    assert (s.completed, s.failed, s.total) == (2, 1, 3)
    assert s.total_input_tokens == 30 and s.total_output_tokens == 6
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(3.0)
    assert s.total_token_throughput == pytest.approx(18.0)
    assert s.ttft.mean == pytest.approx(150.0) and s.ttft.count == 2
    assert s.e2el.median == pytest.approx(400.0)
    assert s.itl.count == 4 and s.itl.mean == pytest.approx(125.0)  # gaps 100, 100, 100, 200
    assert s.tpot.mean == pytest.approx((100.0 + 150.0) / 2)
    assert s.goodput is None


def test_percentiles_and_std_match_numpy():
    ttfts = [0.01 * i for i in range(1, 101)]
    s = summarize([record(0.0, [t]) for t in ttfts], duration_s=1.0)
    ms = np.array(ttfts) * 1000
    assert s.ttft.median == pytest.approx(np.median(ms))
    assert s.ttft.p90 == pytest.approx(np.percentile(ms, 90))
    assert s.ttft.p99 == pytest.approx(np.percentile(ms, 99))
    assert s.ttft.std == pytest.approx(np.std(ms))
    assert s.ttft.p90 == pytest.approx(901.0)  # linear interpolation: 10 + 0.9 * 990


def test_empty_inputs_report_none_not_nan():
    for s in (summarize([], 0.0), summarize([], 5.0), summarize([record(0, [], success=False)], 1.0)):
        d = s.as_dict()
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert all(d[f"{stat}_{name}_ms"] is None for stat in ("mean", "median", "p90", "p99", "std"))
            assert d[f"num_{name}_samples"] == 0
        json.dumps(d, allow_nan=False)  # strict JSON: no NaN anywhere
    assert summarize([], 0.0).request_throughput is None
    assert summarize([], 5.0).request_throughput == 0.0
    only_single = summarize([record(0.0, [0.1])], 1.0)
    assert only_single.tpot == LatencyStats(count=0) and only_single.itl.count == 0


def test_summary_keys_are_vllm_names():
    keys = summary_keys()
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99", "std"):
            assert f"{stat}_{name}_ms" in keys
    for key in ("completed", "failed", "total_requests", "duration_s", "request_throughput",
                "output_throughput", "total_token_throughput", "goodput"):
        assert key in keys


def test_goodput_meets_every_slo():
    fast = record(0.0, [0.1, 0.2, 0.3])  # ttft 100, tpot 100, e2el 300 (ms)
    slow_start = record(0.0, [0.9, 1.0])  # ttft 900
    slow_tokens = record(0.0, [0.1, 0.6, 1.1])  # tpot 500
    single = record(0.0, [0.2])  # no TPOT: passes any TPOT SLO
    failed = record(0.0, [0.01, 0.02], success=False)
    records = [fast, slow_start, slow_tokens, single, failed]
    slos = parse_slos(["ttft:500", "tpot:200"])
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=2.0, slos_ms=slos)
    assert s.goodput == pytest.approx(1.0)
    assert summarize(records, 2.0, parse_slos(["e2el:250"])).goodput == pytest.approx(0.5)  # single only
    assert summarize(records, 2.0, {"ttft": 0.0}).goodput == 0.0
    # The boundary is inclusive.
    assert meets_slos(record(0.0, [0.25]), {"ttft": 250.0})


@pytest.mark.parametrize("bad", ["ttft", "foo:1", "ttft:x", "ttft:-1", "ttft:nan", "ttft:inf"])
def test_parse_slos_rejects(bad):
    with pytest.raises(ValueError):
        parse_slos([bad])


def test_parse_slos_rejects_repeats_and_accepts_case():
    with pytest.raises(ValueError, match="twice"):
        parse_slos(["ttft:1", "ttft:2"])
    assert parse_slos(["TTFT:1.5", "e2el:3"]) == {"ttft": 1.5, "e2el": 3.0}


def test_record_to_dict_is_json():
    d = record(1.0, [1.5, 2.0]).to_dict()
    assert d["ttft_s"] == pytest.approx(0.5) and d["first_token_time"] == 1.5
    json.dumps(d, allow_nan=False)


gaps = st.lists(st.floats(min_value=0.0, max_value=5.0, allow_nan=False), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(send=st.floats(0.0, 1e4), first=st.floats(0.0, 10.0), gaps=gaps)
def test_single_token_chunks_itl_sum_is_e2el_minus_ttft(send, first, gaps):
    times = [send + first]
    for g in gaps:
        times.append(times[-1] + g)
    r = record(send, times)
    assert math.isclose(sum(itls(r)), e2el(r) - ttft(r), rel_tol=1e-9, abs_tol=1e-6)
    # With one token per chunk TPOT is the mean ITL.
    assert math.isclose(tpot(r), sum(itls(r)) / len(itls(r)), rel_tol=1e-9, abs_tol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=50))
def test_stats_are_ordered(values):
    s = LatencyStats.from_seconds(values)
    lo, hi = min(values) * 1000, max(values) * 1000
    eps = 1e-6 * max(1.0, hi)
    assert lo - eps <= s.median <= s.p90 + eps and s.p90 <= s.p99 + eps and s.p99 <= hi + eps
    assert lo - eps <= s.mean <= hi + eps and s.std >= 0
