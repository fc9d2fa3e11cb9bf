"""``benchmarks/fresh_ab.py``'s table: medians per side, their ratio, and where a
speculative run's time went by class of step."""

from __future__ import annotations

from tests.loadgen.conftest import load_benchmark


def _record(speculative: bool, seconds: float, spec_steps: int = 0, drafts: int = 0) -> dict:
    plain_steps = 40 - 2 * spec_steps
    by_class = {"prefill": {"steps": 4, "seconds": 0.5, "tokens": 4},
                "plain": {"steps": plain_steps, "seconds": 0.05 * plain_steps, "tokens": plain_steps},
                "spec": {"steps": spec_steps, "seconds": 0.12 * spec_steps, "tokens": 3 * spec_steps}}
    return {"speculative": speculative, "temperature": 0.0, "tokens": 48, "seconds": seconds, "by_class": by_class,
            "drafts": drafts}


def test_the_table_gives_medians_their_ratio_and_the_time_by_class_of_step():
    fresh_ab = load_benchmark("fresh_ab")
    records = [_record(False, 2.4), _record(False, 2.0), _record(False, 2.2),
               _record(True, 2.4, spec_steps=5, drafts=5), _record(True, 2.0, spec_steps=3, drafts=3)]
    text = fresh_ab.table(records, [0.0])
    plain, speculative = [line for line in text.splitlines() if line.startswith("| 0.0")]
    # Medians: 48 / 2.2 and 48 / 2.2 (the mean of 2.0 and 2.4 by tokens/s is not 2.2).
    assert plain.split(" | ")[2] == f"{48 / 2.2:.2f}" and "1.000x" in plain
    median = (48 / 2.4 + 48 / 2.0) / 2
    assert speculative.split(" | ")[2] == f"{median:.2f}" and f"{median / (48 / 2.2):.3f}x" in speculative
    # Four spec steps on average, 0.48 s, 12 tokens; plain steps at 50 ms each.
    cells = [cell.strip() for cell in speculative.strip("|").split("|")]
    assert cells[5:11] == ["32.0", "50.0", "4.0", "0.480", "12.0", f"{2.2 - 0.5 - 1.6 - 0.48:.3f}"]
