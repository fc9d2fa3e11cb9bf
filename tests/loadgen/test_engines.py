"""benchmarks/engines.py, the shared engine adapters: timing batches and summing
speculation counters, and throughput.py's groups of B prompts (no model loaded)."""

from __future__ import annotations

from tests.loadgen.conftest import load_benchmark


def fake_run(calls: list):
    """A RunBatch that records its batches and reports output_len tokens and counters per prompt."""

    def run(prompts, temperature, output_len):
        calls.append((list(prompts), temperature, output_len))
        return output_len * len(prompts), {"num_drafts": len(prompts), "accepted_per_position": [1] * len(prompts),
                                           "num_target_forward_passes": None}

    return run


def test_time_batches_sums_tokens_and_counters():
    engines = load_benchmark("engines")
    calls: list = []
    tokens, seconds, counters = engines.time_batches(fake_run(calls), [[[1]], [[2], [3]]], 0.5, 3)
    assert calls == [([[1]], 0.5, 3), ([[2], [3]], 0.5, 3)]
    assert tokens == 9 and seconds >= 0
    # Lists add element-wise (padded); a counter the engine does not have stays None.
    assert counters == {"num_drafts": 3, "accepted_per_position": [2, 1], "num_target_forward_passes": None}
    assert engines.time_batches(lambda p, t, n: (n, None), [[[1]]], 0.0, 2)[2] is None


def test_throughput_runs_groups_of_batch_size():
    throughput = load_benchmark("throughput")
    calls: list = []
    prompts = [[i] for i in range(5)]
    result = throughput.run_engine("fake", fake_run(calls), prompts, 2, 4)
    assert [c[0] for c in calls] == [[[0], [1]], [[2], [3]], [[4]]]
    assert all(c[1] == 0.0 and c[2] == 4 for c in calls)  # greedy, --output-len tokens
    assert (result.engine, result.batch_size, result.num_requests, result.output_tokens) == ("fake", 2, 5, 20)
