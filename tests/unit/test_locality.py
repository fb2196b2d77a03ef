"""Host identities in parts, and what each transport needs its peer to share."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import pytest

from asyncrpc.transport import KERNEL, MEMORY, NETWORK, SCHEMES, Host, local_host, locality

HERE = Host(boot="b1", net="n1", pid="p1", uid="1000")


def test_a_host_travels_as_text_and_comes_back_equal() -> None:
    assert str(HERE) == "boot=b1,net=n1,pid=p1,uid=1000"
    assert Host.parse(str(HERE)) == HERE
    assert str(Host(boot="b1", uid="0")) == "boot=b1,uid=0"  # unknown parts are left out


@pytest.mark.parametrize(
    "text", ["", "host-a", "2f1c:4026531836:1000", "boot=,net", "colour=blue,net=n1"]
)
def test_a_text_of_another_form_has_no_known_part_it_does_not_name(text: str) -> None:
    parsed = Host.parse(text)
    assert parsed.boot is None and parsed.pid is None and parsed.uid is None
    assert parsed.refusal(parsed, KERNEL) == "kernel unknown"  # not even equal to itself


@pytest.mark.parametrize(
    ("theirs", "network", "memory"),
    [
        (HERE, None, None),
        (Host(boot="b1", net="n2", pid="p1", uid="1000"), "different network namespace", None),
        (
            Host(boot="b1", net="n2", pid="p2", uid="1000"),  # another pod of this node
            "different network namespace",
            "different PID namespace",
        ),
        (Host(boot="b1", net="n1", pid="p1", uid="0"), None, "different user"),
        (Host(boot="b2", net="n1", pid="p1", uid="1000"), "another host", "another host"),
        (Host(boot="b1", pid="p1", uid="1000"), "network namespace unknown", None),
    ],
)
def test_each_scope_compares_only_its_parts_and_says_which_differs(
    theirs: Host, network: str | None, memory: str | None
) -> None:
    assert HERE.refusal(theirs, NETWORK) == theirs.refusal(HERE, NETWORK) == network
    assert HERE.refusal(theirs, MEMORY) == theirs.refusal(HERE, MEMORY) == memory
    kernel = "another host" if theirs.boot != HERE.boot else None
    assert HERE.refusal(theirs, KERNEL) == kernel


def test_unix_sockets_need_the_network_namespace_and_tcp_nothing() -> None:
    assert SCHEMES["unix"].scope is NETWORK and SCHEMES["tcp"].scope is None


def in_child(before: Callable[[], None] = lambda: None) -> str:
    """``str(local_host())`` as a forked child sees it, after ``before()``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            before()
            os.write(write, str(local_host()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        seen = f.read().decode()
    assert os.waitpid(pid, 0)[1] == 0
    return seen


def test_processes_of_one_namespace_share_every_part() -> None:
    here = local_host()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert here.boot == f.read().strip()
    assert here.net == str(os.stat("/proc/self/ns/net").st_ino)
    assert here.pid == str(os.stat("/proc/self/ns/pid").st_ino)
    assert here.uid == str(os.getuid())
    assert Host.parse(in_child()) == here  # another pid, the same host


def _unshare_network() -> None:
    clone_newnet = 0x40000000
    if ctypes.CDLL(None, use_errno=True).unshare(clone_newnet) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")


@pytest.mark.skipif(os.geteuid() != 0, reason="a new network namespace needs root")
def test_a_process_in_another_network_namespace_shares_memory_but_no_unix_socket() -> None:
    here, there = local_host(), Host.parse(in_child(_unshare_network))
    assert there.net != here.net
    assert here.refusal(there, NETWORK) == "different network namespace"
    assert here.refusal(there, MEMORY) is None


def test_another_user_or_boot_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    here, uid = local_host(), os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    assert here.refusal(local_host(), MEMORY) == "different user"
    assert here.refusal(local_host(), NETWORK) is None
    monkeypatch.setattr(locality, "_read", lambda _: "another-boot")
    assert here.refusal(local_host(), NETWORK) == "another host"


def test_without_proc_nothing_is_proven_so_nothing_is_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_proc(*_: object) -> None:
        raise FileNotFoundError("/proc is not mounted")

    monkeypatch.setattr(locality, "open", no_proc, raising=False)
    monkeypatch.setattr(os, "stat", no_proc)
    blind = local_host()
    assert (blind.boot, blind.net, blind.pid) == (None, None, None)
    assert blind.refusal(blind, NETWORK) == "kernel unknown"
    assert blind.refusal(blind, MEMORY) == "kernel unknown"
