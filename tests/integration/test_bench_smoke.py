"""The side-by-side benchmark still runs end to end (quick mode; no speed is asserted)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cluster import ROOT

pytestmark = pytest.mark.timeout(240)


def test_bench_quick_mode_runs_both_frameworks() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_rpc.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = (
        "no-op round trip",
        "remote + to_here round trip",
        "RRef proxy method call round trip",
        "model-parallel step",
        "pipelined no-op",
        "tensor echo 4 MB",
    )
    for row in rows:
        line = next(x for x in done.stdout.splitlines() if row in x)
        cells = [c.strip() for c in line.split("|")]
        assert cells[2] != "—" and cells[3] != "—", line  # both frameworks measured
