"""Batch services on real worker processes: ``@batch`` behind ``Replicas``, one replica
SIGKILLed mid-run (the workers are in ``tests/serving_scenarios.py``)."""

from __future__ import annotations

import signal

import pytest

from tests.cluster import run_job
from tests.serving_scenarios import MAX_SIZE

pytestmark = pytest.mark.timeout(120)


def test_batched_replicas_fail_over_when_one_is_killed_and_lose_no_call() -> None:
    workers = run_job(
        "serving_scenarios.batched_replicas_lose_one",
        world=3,
        timeout=90,
        expect_exit={2: -signal.SIGKILL},
    )
    seen = workers[0].result
    outcomes = seen["outcomes"]
    assert outcomes["ok"] + outcomes.get("lost", 0) == 400  # every call returned or raised
    assert seen["wrong"] == []
    # only calls already sent to w2 when it died may fail: at most the 64 in flight
    assert outcomes.get("lost", 0) <= 64
    assert seen["served_after_kill"] == {"w1": seen["served_after_kill"]["w1"]}
    assert seen["served_after_kill"]["w1"] >= 200 - 64
    assert seen["live"] == ["w1"]
    # both replicas served, in batches: more than one item per batch, never above max_size
    for stats in seen["stats_before_kill"].values():
        assert stats["items"] > stats["batches"] >= 1
        assert max(int(size) for size in stats["sizes"]) <= MAX_SIZE
    assert seen["stats_w1_at_end"]["waiting"] == 0
