"""The benchmarks still run end to end (quick modes; no speed is asserted): the
side-by-side one, the inference service's load test, and the latency floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import run_script

# bench_rpc's quick mode starts 25 sets of fresh processes (10 jobs for each of 2
# frameworks, 5 for the floor): about a minute on an idle 2-core VM, more beside other
# jobs; bench_service's, two services of 3 processes and a few hundred requests: ~20 s.
pytestmark = pytest.mark.timeout(420)


def test_bench_quick_mode_runs_both_frameworks(tmp_path: Path) -> None:
    results = tmp_path / "bench.json"
    done = run_script("benchmarks/bench_rpc.py", "--quick", "--json", str(results), timeout=400)
    rows = (
        "no-op round trip",
        "remote + to_here round trip",
        "RRef proxy method call round trip",
        "model-parallel step",
        "model-parallel step's compute alone",
        "state dict push (300 tensors, 0.5 MB)",
        "pipelined no-op",
        "no-op round trip, after 256 in flight",
        "tensor echo 4 MB",
        "first echo 4 MB of a fresh pair",
        "steady echo 4 MB, previous result alive",
        "bandwidth curve: echo 1K",
        "bandwidth curve: echo 4M",
        "1 server + 1 client,",
        "1 server + 2 clients,",
        "server total, 2 clients over 1",
        "p50 no-op round trip over 2 fresh pairs",
    )
    for row in rows:
        line = next(x for x in done.stdout.splitlines() if row in x)
        cells = [c.strip() for c in line.split("|")]
        assert cells[2] != "—" and cells[3] != "—", line  # both frameworks measured
    payload = json.loads(results.read_text())
    assert payload["failure"] is None
    assert {p["clients"] for p in payload["curves"]["fanin"]["asyncrpc"]} == {1, 2}
    # The floor ran the same rounds' small-call, fan-in and spread jobs, beside torch.
    assert "The floor, in the same rounds" in done.stdout
    floor = {row["workload"].split(" (")[0].split(",")[0]: row for row in payload["floor_rows"]}
    assert set(floor) == {
        "no-op round trip",
        "coroutine no-op round trip",
        "model-parallel step",
        "model-parallel step's compute alone",
        "pipelined no-op",
        "1 server + 1 client",
        "1 server + 2 clients",
        "server total",
        "p50 no-op round trip over 2 fresh pairs: min to max",
    }
    for row in floor.values():
        assert row["torch_rounds"] and row["asyncrpc_rounds"], row  # torch's and the floor's
        assert all(v > 0 for v in row["asyncrpc_rounds"]), row
    assert results.with_suffix(".png").stat().st_size > 0


def test_service_bench_quick_mode_measures_both_modes_with_no_failure(tmp_path: Path) -> None:
    results, plot = tmp_path / "service.json", tmp_path / "service.png"
    args = ("--quick", "--json", str(results), "--plot", str(plot))
    done = run_script("benchmarks/bench_service.py", *args, timeout=200)
    payload = json.loads(results.read_text())
    assert payload["failed"] == 0
    for mode in ("batched", "unbatched"):
        points = payload["results"][mode]
        assert [p["concurrency"] for p in points] == [1, 16, 64, 256]
        for point in points:
            assert point["ok"] == point["requests"] > 0 and point["failures"] == {}, point
            assert 0 < point["p50_ms"] <= point["p99_ms"], point
    assert set(payload["speedup"]) == {"1", "16", "64", "256"}
    assert "batched / unbatched throughput at concurrency 64" in done.stdout
    assert plot.stat().st_size > 0


def test_latency_floor_measures_every_kind_down_to_the_skeleton_rpc() -> None:
    done = run_script("benchmarks/latency_floor.py", "--calls", "300", "--rounds", "1", timeout=120)
    kinds = (
        "blocking sockets",
        "uvloop protocols",
        "uvloop + busy-poll",
        "uvloop, 256 in flight",
        "skeleton RPC, async def, busy-poll",
        "skeleton RPC, pool thread, busy-poll",
        "skeleton RPC, pool thread, 256 in flight",
    )
    for kind in kinds:
        line = next(x for x in done.stdout.splitlines() if x.strip().startswith(kind))
        assert float(line.split("median")[1].split()[0]) > 0, line
