"""RRefs in real multi-process jobs: churn, the parameter-server pattern, deaths, shutdown."""

from __future__ import annotations

import pytest

from tests.cluster import run_job

pytestmark = pytest.mark.timeout(180)
ZERO = {"owner_rrefs": 0, "user_rrefs": 0}


def test_ten_thousand_rrefs_churned_through_forks_are_all_freed() -> None:
    seen = run_job("rref_scenarios.churn", world=3, timeout=150)[0].result
    assert seen["made"] == 10_000 and seen["owners_kept"]
    assert seen["checked"] == [i * 10 for i in range(0, 500, 50)] * 4
    assert seen["counts"] == [ZERO] * 3


def test_parameter_server_shared_by_trainers() -> None:
    seen = run_job("rref_scenarios.parameter_server", world=4)[0].result
    assert seen["pushes"] == 200
    assert seen["weights"] == [100.0 * (2 + 3)] * 4  # each trainer pushes its rank 100 times
    assert max(seen["trainer_sums"]) == 4 * 500.0
    assert seen["counts"] == [ZERO] * 4


def test_dead_owner_fails_every_use_promptly() -> None:
    seen = run_job("rref_scenarios.owner_killed", world=3, expect_exit={1: -9})[0].result
    assert seen["kept_by_w2"] == "w1"
    for key in ("in_use", "later", "proxy_later", "on_w2"):
        assert seen[key]["connection"] and "w1" in seen[key]["message"], (key, seen[key])
    assert seen["elapsed"] < 10  # the call in use would have run 25 s
    assert seen["shutdown_seconds"] < 10


def test_dead_user_is_released_by_the_owner() -> None:
    seen = run_job("rref_scenarios.user_killed", world=2, expect_exit={1: -9})[0].result
    assert seen["kept_by_w1"] == "w0"
    assert seen["before"]["owner_rrefs"] == 1
    assert seen["after"] == ZERO


def test_shutdown_releases_every_handle() -> None:
    workers = run_job("rref_scenarios.held_at_shutdown", world=3)
    seen = workers[0].result
    assert seen["kept_by_w2"] == 10 and seen["kept_by_w1"] == "w0"
    assert seen["before"] == {"owner_rrefs": 50, "user_rrefs": 1}
    for worker in workers:  # (each shutdown is bounded: over 20 s it raises, the job fails)
        assert worker.result["left"] == ZERO, worker.rank


def test_trainers_share_a_server_with_distributed_autograd() -> None:
    seen = run_job("rref_scenarios.trainers_share_a_server", world=4)[0].result
    for losses in seen["losses"]:
        assert losses[-1] < 0.2 * losses[0], losses
    assert seen["contexts"] == [0, 0, 0, 0]
