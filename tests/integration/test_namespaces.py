"""Two workers in network namespaces of their own, on a bridge (tests/netns.py): two pods
(or containers) of one node.  They share a kernel, but not their abstract unix sockets:
the link must be tcp, and the debug info must say why.  Each sends the other tensors of
1 KB, 1 MB, 64 MB and 400 MB (tests/namespace_scenarios.py), digested and echoed back:
through shared memory from 1 MB while they share a PID namespace, else all on the
socket.  Needs root and iproute2's ``ip``; about 20 s."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from asyncrpc.transport.stripes import STRIPE_MIN
from tests.cluster import Worker
from tests.namespace_scenarios import SIZES, SMALL
from tests.netns import NEEDS_ROOT_AND_IP, Namespace, network, run_in_namespaces

pytestmark = [pytest.mark.timeout(150), *NEEDS_ROOT_AND_IP]


@pytest.fixture
def namespaces() -> Iterator[list[Namespace]]:
    """Two network namespaces on a bridge (see tests/netns.py)."""
    with network(2) as spaces:
        yield spaces


def assert_exchanged(worker: Worker) -> dict[str, Any]:
    """Every size arrived intact both ways; prints the seconds each took (``-s``)."""
    seen = worker.result
    print(f"rank {worker.rank}:", {n: seen[f"{n}_s"] for n in SIZES}, seen["bytes"])
    assert seen["whoami"] == f"w{1 - worker.rank}"
    for nbytes in SIZES:
        assert seen[str(nbytes)] == {"digest": True, "echo": True}, nbytes
    return seen


def test_workers_in_two_network_namespaces_talk_over_tcp_and_say_why(
    namespaces: list[Namespace],
) -> None:
    """One PID namespace still: the large tensors go through shared memory."""
    for worker in run_in_namespaces(namespaces, "namespace_scenarios.exchange"):
        seen = assert_exchanged(worker)
        assert seen["links"] == {
            f"w{1 - worker.rank}": {
                "transport": "tcp",
                "why": "different network namespace",
                "shared_memory": True,
                "shared_memory_why": "same kernel, PID namespace and user",
                "stripes": 0,
                "stripes_why": "shared memory carries large buffers",
            }
        }
        assert seen["shared_memory_peak"] >= SIZES[-1]
        large = sum(SIZES) - SMALL
        assert seen["bytes"]["shared_memory"]["sent"] >= 2 * large  # to blake, to echo
        assert seen["bytes"]["tcp"]["sent"] < 1 << 20  # the calls, and the 1 KB tensors


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's `unshare`")
def test_two_pods_of_one_node_share_neither_sockets_nor_memory(
    namespaces: list[Namespace],
) -> None:
    """Each worker in a PID namespace of its own too (each is pid 1 there): a peer's
    ``/proc/<pid>`` is not that peer, so the large tensors go through the socket."""
    wrap = ("unshare", "--pid", "--fork", "--kill-child")
    for worker in run_in_namespaces(namespaces, "namespace_scenarios.exchange", wrap):
        seen = assert_exchanged(worker)
        assert seen["pid"] == 1
        assert seen["links"] == {
            f"w{1 - worker.rank}": {
                "transport": "tcp",
                "why": "different network namespace",
                "shared_memory": False,
                "shared_memory_why": "different PID namespace",
                "stripes": 2,
                "stripes_why": "both ends offered them",
            }
        }
        assert seen["shared_memory_peak"] == 0
        assert seen["bytes"].get("shared_memory", {"sent": 0})["sent"] == 0
        # 64 and 400 MB cross the side connections (to blake, to echo); the rest the link
        striped = seen["bytes"]["tcp_stripes"]["sent"]
        assert striped >= 2 * sum(n for n in SIZES if n >= STRIPE_MIN)
        assert seen["bytes"]["tcp"]["sent"] + striped >= 2 * sum(SIZES)
