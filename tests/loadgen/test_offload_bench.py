"""The offload benchmark as CI can take it: its ``--device cpu --tiny`` dry run, every
section end to end on tiny random-weight models (host memory standing in for the
device; the figures mean nothing here, the code paths a GPU run takes are the same)."""

from __future__ import annotations

import json

import pytest

from tests.loadgen.conftest import load_benchmark

pytestmark = pytest.mark.triton_interpreter


def test_the_offload_bench_dry_run_gives_every_section(tmp_path):
    bench = load_benchmark("offload_bench")
    out = tmp_path / "offload.json"
    code = bench.main(["--device", "cpu", "--tiny", "--no-progress", "--json", str(out),
                       "--plot", str(tmp_path / "offload.png")])
    report = json.loads(out.read_text())
    assert code == 0, report
    by_section = {f["section"]: f for f in report["figures"]}
    assert set(by_section) == {"bandwidth", "resident", "offloaded", "trees", "peer"}
    # The streamed pass reports the bandwidth it reached against the pinned copy's,
    # and the tree step its cost against the plain offloaded step, with the speed-up
    # at the acceptance measured on CPU.
    offloaded = by_section["offloaded"]
    assert offloaded["detail"]["streamed_bytes"] > 0 and "of the pinned copy's" in offloaded["versus"]
    trees = by_section["trees"]
    assert trees["detail"]["vs_plain"] > 0 and "CPU's acceptance 7.88" in trees["versus"]
    assert (tmp_path / "offload.png").stat().st_size > 0


def test_bad_arguments_are_refused(capsys):
    bench = load_benchmark("offload_bench")
    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "offloaded,nope"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--acceptance", "0.5"])
    assert "unknown sections" in capsys.readouterr().err
