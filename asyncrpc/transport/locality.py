"""Where a worker runs, in parts, and which parts a transport needs its peer to share.

Theory of operation
-------------------
Two workers may share a kernel and still not reach each other's unix sockets or
memory: containers (pods) of one node have network and PID namespaces of their own.
So a worker's host is no single name but parts, each naming one thing processes can
share:

* ``boot``: the kernel (its boot id);
* ``net``: the network namespace (abstract unix sockets live in one);
* ``pid``: the PID namespace (``/proc/<pid>`` names the peer only within it);
* ``uid``: the user (the kernel lets only the same user open a process's descriptors).

A transport that reaches only some processes declares the parts it needs, a
:class:`Scope`: unix sockets ``NETWORK`` (kernel and network namespace), shared
memory ``MEMORY`` (kernel, PID namespace and user).  Two workers use it only when
each of those parts is known on both sides and equal: ``Host.refusal`` says in words
which one is not, for the debug info.  A part that cannot be read (no ``/proc``) is
unknown and matches nothing, so a transport is used where it is proven, never where
it is assumed.  The text form (``str``, ``Host.parse``) travels where the single host
string did (the rendezvous' ``WorkerAddress.host``, the handshake's ``Identity.host``);
a text this version cannot read has no known parts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Final


@dataclass(frozen=True, slots=True)
class Scope:
    """What a transport needs shared with its peer: ``parts`` of a :class:`Host`,
    together called ``name``."""

    name: str
    parts: tuple[str, ...]


KERNEL: Final = Scope("kernel", ("boot",))
NETWORK: Final = Scope("network namespace", ("boot", "net"))
MEMORY: Final = Scope("kernel, PID namespace and user", ("boot", "pid", "uid"))

_WHAT: Final = {
    "boot": "kernel",
    "net": "network namespace",
    "pid": "PID namespace",
    "uid": "user",
}
"""Each part, in words."""


@dataclass(frozen=True, slots=True)
class Host:
    """A process's place, part by part (None: unknown); see the module docstring."""

    boot: str | None = None
    net: str | None = None
    pid: str | None = None
    uid: str | None = None

    def __str__(self) -> str:
        known = (f.name for f in fields(self) if getattr(self, f.name) is not None)
        return ",".join(f"{part}={getattr(self, part)}" for part in known)

    @classmethod
    def parse(cls, text: str) -> Host:
        """The host ``str`` wrote; parts it does not name (or a text of another form)
        are unknown."""
        found: dict[str, str] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if sep and key in _WHAT and value:
                found[key] = value
        return cls(**found)

    def refusal(self, other: Host, scope: Scope) -> str | None:
        """None if ``other`` shares every part ``scope`` needs; else why not, in words."""
        for part in scope.parts:
            ours, theirs = getattr(self, part), getattr(other, part)
            if ours is None or theirs is None:
                return f"{_WHAT[part]} unknown"
            if ours != theirs:
                return "another host" if part == "boot" else f"different {_WHAT[part]}"
        return None


def local_host() -> Host:
    """This process's host, each part as far as ``/proc`` tells."""
    return Host(
        boot=_read("/proc/sys/kernel/random/boot_id"),
        net=_namespace("net"),
        pid=_namespace("pid"),
        uid=str(os.getuid()),
    )


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _namespace(kind: str) -> str | None:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return None
