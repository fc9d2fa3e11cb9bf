"""The serving benchmark against a real pagedtree server on loopback (tiny model), both protocols.

Token counts are checked three ways: the records' sum, what the server reported
(usage / details), and the engine's own generated-token counter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import pytest

from pagedtree.loadgen.serving_metrics import summary_keys
from pagedtree.loadgen.serving import BenchmarkConfig, arrival_offsets, main, run_benchmark
from pagedtree.entrypoints import cli
from tests.entrypoints.conftest import wait_until_idle

NUM_PROMPTS = 12


def bench(server, chat_model_path, **overrides) -> tuple[dict, dict]:
    """Run a benchmark in-process; returns (result, engine counter deltas)."""
    options = dict(base_url=server.url, model="tiny", tokenizer=str(chat_model_path), input_len=8, output_len=6,
                   range_ratio=0.5, num_prompts=NUM_PROMPTS, ignore_eos=True, disable_tqdm=True, timeout=60)
    config = BenchmarkConfig(**(options | overrides))
    before = wait_until_idle(server)
    result = asyncio.run(run_benchmark(config))
    after = wait_until_idle(server)
    delta = {key: after[key] - before[key] for key in ("num_generated_tokens", "num_prompt_tokens")}
    return result, delta


def check_complete_run(result: dict, delta: dict, source: str) -> None:
    """Every key, every request completed, and the token counts agree with the server and the engine."""
    summary, records = result["summary"], result["requests"]
    assert set(summary_keys()) <= set(summary)
    assert summary["completed"] + summary["failed"] == summary["total_requests"] == len(records) == NUM_PROMPTS
    assert summary["failed"] == 0, result["errors"]
    assert all(r["output_tokens_source"] == source for r in records)
    output = sum(r["output_tokens"] for r in records)
    assert summary["total_output_tokens"] == output
    warmup = result["warmup"]
    assert warmup is not None and warmup["success"]
    # The engine counted the warm-up too; nothing else ran meanwhile.
    assert delta["num_generated_tokens"] == output + warmup["output_tokens"]
    assert delta["num_prompt_tokens"] == summary["total_input_tokens"] + warmup["prompt_tokens"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99", "std"):
            assert summary[f"{stat}_{name}_ms"] is not None, (stat, name)
    for r in records:
        assert r["send_time"] < r["first_token_time"] <= r["end_time"] == r["chunk_times"][-1]
        assert r["chunk_times"] == sorted(r["chunk_times"])
        assert 1 <= len(r["chunk_times"]) <= r["output_tokens"]
    json.dumps(result, allow_nan=False)


def max_overlap(records: list[dict]) -> int:
    """Most requests between their send time and their last chunk at any moment."""
    events = sorted([(r["send_time"], 1) for r in records] + [(r["end_time"], -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


def test_openai_poisson_arrivals(server, chat_model_path, tmp_path):
    path = tmp_path / "out" / "openai.json"
    result, delta = bench(server, chat_model_path, backend="openai", request_rate=20.0, seed=3,
                          goodput={"ttft": 60_000.0, "e2el": 60_000.0}, save_result=str(path))
    check_complete_run(result, delta, source="usage")
    records, summary = result["requests"], result["summary"]
    # ignore_eos: the server generated exactly what was asked.
    assert [r["output_tokens"] for r in records] == [r["expected_output_tokens"] for r in records]
    assert all(3 <= r["expected_output_tokens"] <= 9 for r in records)  # 6 * (1 -+ 0.5)
    # Sends follow the seeded Poisson schedule (never early).
    sends = sorted(r["send_time"] for r in records)
    assert sends[-1] - sends[0] >= arrival_offsets(NUM_PROMPTS, 20.0, 3)[-1] - 0.005
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # generous SLOs: all pass
    saved = json.loads(path.read_text())
    assert saved["summary"] == summary and saved["config"]["request_rate"] == 20.0
    assert len(saved["requests"]) == NUM_PROMPTS


def test_tgi_all_at_once_with_max_concurrency(server, chat_model_path):
    result, delta = bench(server, chat_model_path, backend="tgi", request_rate=float("inf"), max_concurrency=3,
                          ignore_eos=False)
    check_complete_run(result, delta, source="details")
    records = result["requests"]
    # TGI sends one event per token, so chunks and tokens agree.
    assert all(len(r["chunk_times"]) == r["output_tokens"] <= r["expected_output_tokens"] for r in records)
    assert max_overlap(records) <= 3
    assert result["config"]["request_rate"] == "inf"


def test_server_errors_fail_their_requests_and_the_run_completes(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello", "output_len": 4}\n'
                       '{"prompt": "world", "output_len": 1000}\n'  # beyond max_model_len: HTTP 400
                       '{"prompt": "fox", "output_len": 3}\n')
    config = BenchmarkConfig(base_url=server.url, model="tiny", dataset="file", dataset_path=str(prompts),
                             num_prompts=3, ignore_eos=True, disable_tqdm=True, warmup=False, timeout=60)
    result = asyncio.run(run_benchmark(config))
    summary, records = result["summary"], result["requests"]
    assert (summary["completed"], summary["failed"], summary["total_requests"]) == (2, 1, 3)
    assert not records[1]["success"] and records[1]["error"].startswith("HTTP 400")
    assert summary["total_output_tokens"] == 7
    wrong_model = asyncio.run(run_benchmark(dataclasses.replace(config, model="nope")))
    assert wrong_model["summary"]["failed"] == 3
    assert all("HTTP 404" in r["error"] for r in wrong_model["requests"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_gives_failed_records(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    url = f"http://127.0.0.1:{free_port()}"
    for backend in ("openai", "tgi"):
        config = BenchmarkConfig(backend=backend, base_url=url, dataset="file", dataset_path=str(prompts),
                                 num_prompts=3, disable_tqdm=True, warmup=False, timeout=10)
        result = asyncio.run(run_benchmark(config))
        summary = result["summary"]
        assert (summary["completed"], summary["failed"]) == (0, 3)
        assert summary["mean_ttft_ms"] is None and summary["request_throughput"] == 0.0
        assert all(r["error"] for r in result["requests"])
        json.dumps(result, allow_nan=False)
    # With the warm-up on, the command stops at once and says why.
    assert main(["--base-url", url, "--dataset", "file", "--dataset-path", str(prompts), "--disable-tqdm"]) == 1


def test_cli_bench_serve_runs_and_saves(server, chat_model_path, tmp_path, capsys):
    path = tmp_path / "cli.json"
    code = cli.main(["bench", "serve", "--base-url", server.url, "--model", "tiny", "--tokenizer",
                     str(chat_model_path), "--input-len", "6", "--output-len", "3", "--num-prompts", "3",
                     "--ignore-eos", "--disable-tqdm", "--goodput", "ttft:60000", "--save-result", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "Successful requests:" in out and "Mean TTFT (ms):" in out and "Request goodput" in out
    saved = json.loads(path.read_text())
    assert saved["summary"]["completed"] == 3 and saved["summary"]["total_output_tokens"] == 9


def test_bad_options_exit_2(capsys):
    assert main(["--goodput", "latency:5"]) == 2
    assert "goodput" in capsys.readouterr().err


def test_pagedtree_bench_serve_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "pagedtree bench serve" in out and "--request-rate" in out and "--goodput" in out


