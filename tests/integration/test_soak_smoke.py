"""The soak benchmark runs end to end (a few seconds of traffic) and judges its own run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.cluster import ROOT, run_script

pytestmark = pytest.mark.timeout(240)


def test_short_soak_loses_no_call_and_every_worker_exits_0(tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    done = run_script(
        "benchmarks/soak.py", "--duration", "6", "--json", str(report_path), timeout=220
    )
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["problems"] == [], report["problems"]
    assert [w["exit_code"] for w in report["workers"]] == [0, 0, 0]
    for worker in report["workers"]:
        seen = worker["report"]
        totals = seen["totals"]
        assert totals["issued"] == totals["completed"] + totals["failed"], totals
        assert totals["unexpected"] == 0 and seen["lost"] == [], seen["lost"]
        for kind in KINDS:
            assert seen["kinds"][kind]["issued"] > 0, kind
        assert seen["kinds"]["remote_error"]["failed"] == {
            "ValueError": seen["kinds"]["remote_error"]["issued"]
        }
        assert len(seen["samples"]) >= 3 and all(s["rss_mb"] > 0 for s in seen["samples"])
        assert all(v == 0 for v in seen["left_at_close"].values()), seen["left_at_close"]
    assert "soak passed" in done.stdout


def load_soak() -> ModuleType:
    """benchmarks/soak.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("soak", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


KINDS = load_soak().REQUIRED_KINDS
"""Every kind of call a soak worker makes: each stream must have issued some."""


def clean_report() -> dict[str, Any]:
    kinds = {kind: {"issued": 10, "completed": 10, "failed": {}, "unexpected": 0} for kind in KINDS}
    kinds["remote_error"] = {
        "issued": 2,
        "completed": 0,
        "failed": {"ValueError": 2},
        "unexpected": 0,
    }
    return {
        "totals": {"issued": 100, "completed": 98, "failed": 2, "unexpected": 0},
        "lost": [],
        "kinds": kinds,
        "crashed": [],
        "left_at_close": {"owner_rrefs": 0, "user_rrefs": 0, "autograd_contexts": 0},
        "losses": [2.0, 0.1],
        "steps": 50,
    }


def test_soak_verdict_flags_lost_calls_unexpected_failures_and_leaks() -> None:
    judge = load_soak().judge
    assert judge("w0", clean_report()) == []

    lost = clean_report()
    lost["totals"]["completed"] = 97  # one call never ended
    lost["lost"] = [{"kind": "noop", "age_s": 45.0}]
    assert any("1 lost calls" in p for p in judge("w0", lost))

    unexpected = clean_report()
    unexpected["kinds"]["tensor_shm"].update(
        unexpected=1, unexpected_samples=["PeerLostError: lost connection to worker 'w1'"]
    )
    assert any("1 unexpected outcomes (tensor_shm 1)" in p for p in judge("w0", unexpected))

    leak = clean_report()
    leak["left_at_close"]["owner_rrefs"] = 3
    assert any("left at close" in p for p in judge("w0", leak))

    idle = clean_report()
    idle["kinds"]["tensor_shm"]["issued"] = 0
    assert any("no tensor_shm call" in p for p in judge("w0", idle))
