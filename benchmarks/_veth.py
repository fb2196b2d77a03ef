"""Two "hosts" on one machine for the benchmarks: two network namespaces joined by one
veth pair (needs root and iproute2's ``ip``).

``veth_pair()`` makes namespaces ``abv<tag>n0`` and ``abv<tag>n1``, each holding one end
of one veth pair (``abv<tag>v0``, ``abv<tag>v1``; 10.214.N.1 and 10.214.N.2/24) and its
loopback up; ``<tag>`` and ``N`` come from our pid, so concurrent runs do not meet.  The
root namespace is not touched, and both namespaces (the pair goes with them) are deleted
whatever happens.  By hand::

    ip netns add A; ip netns add B
    ip link add va netns A type veth peer name vb netns B
    ip -n A addr add 10.214.1.1/24 dev va; ip -n A link set va up; ip -n A link set lo up
    ip -n B addr add 10.214.1.2/24 dev vb; ip -n B link set vb up; ip -n B link set lo up

``wrap(ns, command)`` runs a command in one of them (``ip netns exec``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

IP_TIMEOUT_S = 10.0
"""Per ``ip`` command."""


class VethUnavailableError(RuntimeError):
    """Namespaces or a veth pair cannot be made here (not root, no ``ip``, refused)."""


@dataclass(frozen=True, slots=True)
class Namespace:
    """A "host": a network namespace, its address, and its end of the veth pair."""

    name: str
    address: str
    veth: str


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None if they may be."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces and veth pairs needs root"
    return None


def ip(*args: str) -> None:
    try:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        what = exc.stderr.decode(errors="replace").strip()
        raise VethUnavailableError(f"`ip {' '.join(args)}` failed: {what}") from exc
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VethUnavailableError(f"`ip {' '.join(args)}` failed: {exc}") from exc


@contextmanager
def veth_pair() -> Iterator[tuple[Namespace, Namespace]]:
    """Two fresh namespaces joined by one veth pair, 10.214.N.1 and .2 /24 (N from our
    pid); both deleted whatever happens.  Raises ``VethUnavailableError`` if they cannot be
    made (what was made is deleted first)."""
    if why := unavailable():
        raise VethUnavailableError(why)
    pid = os.getpid()
    tag, subnet = f"{pid % 100000}", f"10.214.{pid % 250 + 1}"
    a, b = (  # interface names: 15 characters at most ("abv" + 5 digits + "v0": 10)
        Namespace(f"abv{tag}n{i}", f"{subnet}.{i + 1}", f"abv{tag}v{i}") for i in range(2)
    )
    made: list[str] = []
    try:
        for ns in (a, b):
            ip("netns", "add", ns.name)
            made.append(ns.name)
        peer = ("type", "veth", "peer", "name", b.veth, "netns", b.name)
        ip("link", "add", a.veth, "netns", a.name, *peer)
        for ns in (a, b):
            ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", ns.veth)
            ip("-n", ns.name, "link", "set", ns.veth, "up")
            ip("-n", ns.name, "link", "set", "lo", "up")
        yield a, b
    finally:
        for name in made:  # a namespace's interfaces, and their veth peers, go with it
            subprocess.run(
                ["ip", "netns", "del", name], check=False, capture_output=True, timeout=IP_TIMEOUT_S
            )


def wrap(ns: Namespace, command: list[str]) -> list[str]:
    """``command`` run inside ``ns``."""
    return ["ip", "netns", "exec", ns.name, *command]
