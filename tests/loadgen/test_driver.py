"""Benchmark driver parts without a server: SSE parsing, arrival times, concurrency, options."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from pagedtree.loadgen.backends import RequestInput, SSEParser
from pagedtree.loadgen.serving_metrics import RequestRecord
from pagedtree.loadgen.serving import BenchmarkConfig, arrival_offsets, format_table, run_requests


def test_sse_parser_splits_events_across_reads():
    parser = SSEParser()
    stream = b'data: {"a": 1}\n\ndata:{"b"' + b': 2}\r\n\r\n: keep-alive\n\nevent: x\ndata: [DONE]\n\n'
    events = []
    for i in range(0, len(stream), 5):  # arbitrary network reads
        events += parser.feed(stream[i:i + 5])
    assert events == ['{"a": 1}', '{"b": 2}', "[DONE]"]
    assert parser.close() == []


def test_sse_parser_multiline_data_and_unterminated_last_event():
    parser = SSEParser()
    assert parser.feed(b"data: one\ndata: two\n\ndata: last") == ["one\ntwo"]
    assert parser.close() == ["last"]


def test_sse_parser_keeps_split_utf8_whole():
    parser = SSEParser()
    payload = 'data: {"t": "é€"}\n\n'.encode()
    cut = payload.index(b"\xe2") + 1  # inside the euro sign
    assert parser.feed(payload[:cut]) == []
    assert parser.feed(payload[cut:]) == ['{"t": "é€"}']


def test_poisson_offsets_are_seeded_with_the_asked_rate():
    a = arrival_offsets(2000, 50.0, seed=1)
    assert a == arrival_offsets(2000, 50.0, seed=1) and a != arrival_offsets(2000, 50.0, seed=2)
    assert a[0] == 0.0 and a == sorted(a)
    assert 2000 / a[-1] == pytest.approx(50.0, rel=0.1)
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_run_requests_keeps_order_and_the_concurrency_limit():
    in_flight = most = 0

    async def send(inp: RequestInput) -> RequestRecord:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        started = time.perf_counter()
        await asyncio.sleep(0.01 * (inp.output_len % 3))
        in_flight -= 1
        return RequestRecord(expected_output_tokens=inp.output_len, send_time=started, success=True)

    inputs = [RequestInput(prompt=str(i), output_len=i) for i in range(10)]
    records, duration = asyncio.run(run_requests(send, inputs, [0.0] * 10, max_concurrency=2))
    assert [r.expected_output_tokens for r in records] == list(range(10))
    assert most == 2 and duration > 0


def test_run_requests_waits_for_the_arrival_times():
    async def send(inp: RequestInput) -> RequestRecord:
        return RequestRecord(send_time=time.perf_counter(), success=True)

    async def main():
        start = time.perf_counter()
        records, _ = await run_requests(send, [RequestInput("a", 1), RequestInput("b", 1)], [0.0, 0.05])
        return [r.send_time - start for r in records]

    first, second = asyncio.run(main())
    assert first < 0.04 <= 0.049 <= second


@pytest.mark.parametrize("bad", [dict(backend="vllm"), dict(request_rate=0.0), dict(max_concurrency=0),
                                 dict(temperature=-1.0), dict(timeout=0.0), dict(goodput={"ttft": -1.0})])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        BenchmarkConfig(**bad).validate()


def test_table_shows_none_as_na():
    from pagedtree.loadgen.serving_metrics import summarize

    result = {"config": BenchmarkConfig().to_json(), "summary": summarize([], 0.0).as_dict(),
              "errors": {"HTTP 500: boom": 2}}
    table = format_table(result)
    assert "Mean TTFT (ms):" in table and "n/a" in table and "2 failed: HTTP 500: boom" in table
    assert result["config"]["request_rate"] == "inf"
