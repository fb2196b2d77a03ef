"""A network partition between two workers in network namespaces of their own (on a
bridge, see tests/netns.py), mid-job: the peer's end of its cable to the bridge goes down
and comes back up.

Calls in flight fail with ``PeerLostError`` within ``silent_peer_timeout`` (plus a
margin), not their 30 s ``rpc_timeout``; new calls fail fast while the partition
lasts; once it heals new calls succeed, without restarting the job; both workers then
shut down gracefully.  The scenario is tests/partition_scenarios.py.  Needs root and
iproute2's ``ip``; about 15 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.netns import NEEDS_ROOT_AND_IP, Namespace, network, run_in_namespaces
from tests.partition_scenarios import CUT_ENV, LONG_WORK, MODE_ENV, SHUTDOWN_TIMEOUT, SILENCE

pytestmark = [pytest.mark.timeout(120), *NEEDS_ROOT_AND_IP]
MARGIN = 3.0  # seconds past SILENCE for the loss to be seen (a loaded 2-core box)
FAIL_FAST = 2.0  # seconds a new call may take to fail while the partition lasts
RECOVERY = 5.0  # seconds from healing to a call that goes through


@pytest.fixture
def namespaces() -> Iterator[list[Namespace]]:
    with network(2) as spaces:
        yield spaces


def failed(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in calls if c["error"] is not None]


@pytest.mark.parametrize("mode", ["busy", "idle"])
def test_a_partition_fails_calls_within_the_bound_and_heals_without_a_restart(
    namespaces: list[Namespace], mode: str
) -> None:
    """``busy``: requests keep going out, unacknowledged (TCP_USER_TIMEOUT ends the
    link); ``idle``: long calls wait for their replies and nothing flows (keepalive)."""
    peer = namespaces[1]
    env = {CUT_ENV: f"{peer.name} {peer.veth}", MODE_ENV: mode}
    w0, w1 = run_in_namespaces(namespaces, "partition_scenarios.partition", env=env)
    seen = w0.result
    print(json.dumps(seen, indent=1))  # the timeline, for a failure's report (pytest -s)
    calls, lost, heal = seen["calls"], seen["lost"], seen["heal"]
    report = f"lost at {lost:.2f}s, healed at {heal:.2f}s, back at {seen['back']:.2f}s"

    # Calls in flight at the cut, or made before the loss was seen: lost together.
    in_flight = [c for c in calls if c["start"] < lost and c["end"] > seen["cut_done"]]
    assert in_flight, report
    for call in failed(in_flight):
        assert call["error"].startswith("PeerLostError: "), call
        assert "'w1'" in call["error"], call
        assert call["end"] < SILENCE + MARGIN, (call, report)
    assert failed(in_flight), report  # the calls made after the cut could not succeed
    if mode == "idle":
        assert all(c["error"] for c in in_flight if c["start"] < 0), report
        assert SILENCE + MARGIN < LONG_WORK  # they did not just end
    assert 1.0 < lost < SILENCE + MARGIN, report  # the kernel's bound, not an instant error

    # While the partition lasts, every new call fails fast, saying it never left.
    during = [c for c in calls if lost < c["start"] and c["end"] < heal]
    assert len(during) >= 2, report
    for call in during:
        assert call["error"] is not None, (call, report)
        assert call["error"].startswith("PeerLostError: "), call
        assert call["details"]["worker"] == "w1", call
        assert call["details"]["sent"] is False, call
        assert call["end"] - call["start"] < FAIL_FAST, (call, report)

    # Healed: a new call goes through, on a new link; nobody counts the other dead any
    # more, and both shut down gracefully.
    assert seen["back"] - heal < RECOVERY, report
    assert seen["links"]["w1"]["transport"] == "tcp"
    assert (seen["dead_during"], seen["dead_peers"], w1.result["dead_peers"]) == (["w1"], [], [])
    for worker in (w0, w1):
        assert worker.result["shutdown_s"] < SHUTDOWN_TIMEOUT
