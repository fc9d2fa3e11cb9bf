"""The rows of a check report, the table they print as, and its JSON form."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASS = "pass"
FAIL = "FAIL"
SKIPPED = "skipped"
INFO = "info"
VERDICTS = (PASS, FAIL, SKIPPED, INFO)

COLUMNS = ("check", "case", "result", "figure", "verdict")


@dataclass(slots=True)
class Row:
    """One line of the report: what was checked, on which case, what came out, the
    number behind it, and the verdict (``pass``, ``FAIL``, ``skipped`` or ``info``)."""

    check: str
    case: str
    result: str
    figure: str
    verdict: str
    detail: dict = field(default_factory=dict)  # JSON only: per-case numbers

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def cells(self) -> tuple[str, str, str, str, str]:
        """The row's five printed cells."""
        return self.check, self.case, self.result, self.figure, self.verdict


def skipped(check: str, case: str, why: str) -> Row:
    """A row for a case this machine cannot run (``why``: e.g. "no CUDA")."""
    return Row(check, case, f"skipped ({why})", "-", SKIPPED)


def failed_run(check: str, case: str, exc: BaseException) -> Row:
    """A row for a check that raised instead of giving a result."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return Row(check, case, f"error: {type(exc).__name__}", message[:160] or "-", FAIL)


def any_failed(rows: Sequence[Row]) -> bool:
    """Whether any row's verdict is a failure."""
    return any(row.verdict == FAIL for row in rows)


def format_table(rows: Sequence[Row]) -> str:
    """The rows as one aligned text table with a header and a rule."""
    cells = [COLUMNS] + [row.cells() for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(COLUMNS), rule] + [line(c) for c in cells[1:]])


def summary_line(rows: Sequence[Row], seconds: float) -> str:
    """One line counting the verdicts, e.g. ``12 pass, 0 FAIL, 3 skipped, 4 info in 31 s``."""
    counts = {v: sum(row.verdict == v for row in rows) for v in VERDICTS}
    verdict = "FAILED" if counts[FAIL] else "PASSED"
    return (f"{verdict}: {counts[PASS]} pass, {counts[FAIL]} FAIL, {counts[SKIPPED]} skipped, "
            f"{counts[INFO]} info in {seconds:.0f} s")


def write_json(path: str | Path, rows: Sequence[Row], environment: dict, seconds: float) -> None:
    """The report as JSON: the machine, every row (with its per-case detail), the
    overall verdict and the wall time."""
    data = dict(environment=environment, passed=not any_failed(rows), seconds=round(seconds, 2),
                columns=list(COLUMNS), rows=[asdict(row) for row in rows])
    Path(path).write_text(json.dumps(data, indent=1, default=str))
