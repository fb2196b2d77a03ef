"""The agent's dial plan: which transport reaches a peer, the fallback, and why."""

from __future__ import annotations

import pytest

from asyncrpc.agent.routes import Route, Routes
from asyncrpc.agent.worker import WorkerAddress
from asyncrpc.errors import PeerLostError
from asyncrpc.transport import Host

HERE = Host(boot="b1", net="n1", pid="p1", uid="0")
BOTH = {"unix": "unix://@w1", "tcp": "tcp://10.0.0.2:7000"}


def peer(host: Host, addresses: dict[str, str] | None = None) -> WorkerAddress:
    return WorkerAddress("w1", 1, str(host), dict(BOTH if addresses is None else addresses))


def plan(target: WorkerAddress, transports: tuple[str, ...] = ("unix", "tcp")) -> list[Route]:
    return Routes(transports, HERE).plan(target)


def test_a_peer_of_our_network_namespace_is_dialed_on_unix_then_tcp() -> None:
    assert plan(peer(HERE)) == [
        Route("unix", "unix://@w1", "same network namespace"),
        Route("tcp", "tcp://10.0.0.2:7000", "first of transports ['unix', 'tcp']"),
    ]


@pytest.mark.parametrize(
    ("theirs", "why"),
    [
        (Host(boot="b1", net="n2", pid="p2", uid="0"), "different network namespace"),
        (Host(boot="b2", net="n1", pid="p1", uid="0"), "another host"),
        (Host(boot="b1", pid="p1", uid="0"), "network namespace unknown"),
    ],
)
def test_a_peer_outside_our_network_namespace_is_dialed_on_tcp_only(theirs: Host, why: str) -> None:
    assert plan(peer(theirs)) == [Route("tcp", "tcp://10.0.0.2:7000", why)]


def test_the_plan_ends_at_the_first_transport_that_reaches_anywhere() -> None:
    assert plan(peer(HERE), ("tcp", "unix")) == [
        Route("tcp", "tcp://10.0.0.2:7000", "first of transports ['tcp', 'unix']")
    ]


def test_a_scheme_the_peer_does_not_offer_is_skipped_and_said() -> None:
    only_tcp = peer(HERE, {"tcp": BOTH["tcp"]})
    assert plan(only_tcp) == [Route("tcp", BOTH["tcp"], "'w1' offers no unix")]


def test_no_common_transport_fails_the_dial_saying_why() -> None:
    far = peer(Host(boot="b2"), {"unix": BOTH["unix"]})
    with pytest.raises(PeerLostError) as info:
        plan(far)
    why = "another host; 'w1' offers no tcp"
    assert str(info.value) == f"no common transport with worker 'w1' ({why})"
    assert info.value.details == {"worker": "w1", "sent": False}


def test_a_refused_route_is_remembered_for_that_peer_and_said() -> None:
    routes = Routes(("unix", "tcp"), HERE)
    unix, _ = routes.plan(peer(HERE))
    refused = PeerLostError("cannot connect", worker="w1", unreachable=True)
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    routes.refused("w1", unix, refused)
    why = "unix dial failed: [Errno 111] Connection refused"
    assert routes.plan(peer(HERE)) == [Route("tcp", BOTH["tcp"], why)]  # and ever after
    other = WorkerAddress("w2", 2, str(HERE), BOTH)
    assert [r.scheme for r in routes.plan(other)] == ["unix", "tcp"]  # only for that peer


def test_why_reports_the_route_a_link_was_made_on() -> None:
    routes = Routes(("unix", "tcp"), HERE)
    assert routes.why("w1") == {}
    tcp = routes.plan(peer(Host(boot="b1", net="n2", pid="p1", uid="0")))[0]
    routes.chosen("w1", tcp)
    assert routes.why("w1") == {"transport": "tcp", "why": "different network namespace"}


def test_contact_lost_is_remembered_from_its_first_cause_until_a_dial_succeeds() -> None:
    routes = Routes(("tcp",), HERE)
    assert routes.lost_contact("w1") is None
    routes.lost("w1", "silent for 10s")
    routes.lost("w1", "no route to host")  # the outage goes on: its start is kept
    assert routes.lost_contact("w1") == "silent for 10s"
    assert routes.lost_contact("w2") is None  # only for that peer
    routes.chosen("w1", routes.plan(peer(Host(boot="b2")))[0])
    assert routes.lost_contact("w1") is None
