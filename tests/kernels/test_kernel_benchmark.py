"""benchmarks/kernels.py runs end to end (on CPU: the interpreter, --quick shapes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


@pytest.mark.slow
def test_quick_run_reports_every_kernel(tmp_path):
    out = tmp_path / "kernels.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--iters", "1", "--warmup", "0", "--output-json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    impls = {(r["impl"], r["nodes"]) for r in report["rows"]}
    assert {("decode", 1), ("tree", 4), ("tree", 8), ("sdpa", 4)} <= impls
    assert all(r["time_us"] > 0 and r["gbps"] > 0 for r in report["rows"])
    # The benchmark checks the tree kernel against SDPA; a mismatch would be a note.
    assert not any("differs" in n for n in report["notes"]), report["notes"]
    assert "| tree |" in result.stdout
