"""Several "hosts" on one machine: network namespaces on a bridge (needs root).

``network(count)`` makes ``count`` fresh network namespaces, ``arpc<tag>n<i>``, and one
more, ``arpc<tag>br``, holding a bridge; each host namespace holds one end of a veth
pair (``arv<tag>n<i>``, address 10.213.N.<i + 1>/24), whose other end
(``arv<tag>p<i>``) is a port of the bridge: a switch with ``count`` machines on it.
``<tag>`` and ``N`` come from our pid, so concurrent runs do not meet; the root
namespace is not touched, and everything is deleted whatever happens.  By hand::

    ip netns add SW; ip -n SW link add br0 type bridge; ip -n SW link set br0 up
    ip netns add A                                  # and B, C, ... likewise
    ip link add va netns A type veth peer name pa netns SW   # a cable to the switch
    ip -n SW link set pa master br0 up
    ip -n A addr add 10.213.1.1/24 dev va; ip -n A link set va up; ip -n A link set lo up

``run_in_namespaces`` runs rank r of a scenario (``tests/worker.py``) in namespace r
with ``ip netns exec``, the rendezvous at rank 0's address; ``start_in`` runs any
command in one (tests/integration/test_multihost.py runs torchrun so), and
``Followed`` reads such a command's output line by line as it comes, so that a test
can wait for a line (bounded) while the command runs.  Used by
tests/integration/test_namespaces.py, test_partition.py and test_multihost.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import pytest

import asyncrpc
from tests.cluster import ROOT, Worker, free_port

if TYPE_CHECKING:
    from tests.scenarios import Config

RENDEZVOUS_ENV = "ASYNCRPC_TEST_RENDEZVOUS_HOST"
LISTEN_ENV = "ASYNCRPC_TEST_LISTEN_HOST"
IP_TIMEOUT = 10.0  # seconds, per `ip` command
JOB_TIMEOUT = 90.0  # seconds, for all the processes of a job together
NEEDS_ROOT_AND_IP = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or shutil.which("ip") is None,
        reason="network namespaces need Linux and iproute2's `ip`",
    ),
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0,
        reason="creating network namespaces, veth pairs and bridges needs root",
    ),
]


@dataclass(frozen=True)
class Namespace:
    """A "host": a network namespace, its address, and its end of its cable."""

    name: str
    address: str  # its end of the veth pair
    veth: str  # the name of that end


async def join_from_namespace(cfg: Config, **options: Any) -> None:
    """``init_rpc`` for a worker run by :func:`run_in_namespaces`: rendezvous at the
    address and listening on the one its environment names (``cfg``: a scenario's
    ``tests.scenarios.Config``)."""
    await asyncrpc.init_rpc(
        cfg.name,
        rank=cfg.rank,
        world_size=cfg.world,
        init_method=f"tcp://{os.environ[RENDEZVOUS_ENV]}:{cfg.port}",
        listen_host=os.environ[LISTEN_ENV],
        **options,
    )


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT)


def _make_bridge(switch: str) -> None:
    """A namespace holding ``br0``, an L2 switch (no STP, no forwarding delay)."""
    try:
        ip("netns", "add", switch)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
    try:
        ip("-n", switch, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a bridge here: {exc.stderr.decode().strip()}")
    ip("-n", switch, "link", "set", "br0", "up")


def _plug(ns: Namespace, switch: str, port: str) -> None:
    """Make ``ns`` and cable it to the switch: a veth pair, ``ns.veth`` in ``ns`` (with
    its address), ``port`` on the bridge."""
    ip("netns", "add", ns.name)
    cable = ("type", "veth", "peer", "name", port, "netns", switch)
    ip("link", "add", ns.veth, "netns", ns.name, *cable)
    ip("-n", switch, "link", "set", port, "master", "br0", "up")
    ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", ns.veth)
    ip("-n", ns.name, "link", "set", ns.veth, "up")
    ip("-n", ns.name, "link", "set", "lo", "up")


@contextmanager
def network(count: int = 2) -> Iterator[list[Namespace]]:
    """``count`` fresh network namespaces on one bridge, 10.213.N.1, .2, ... /24 (N
    from our pid: unique among concurrent runs of this machine); all deleted (cables
    and bridge with them) whatever happens.  Skips the test if namespaces or bridges
    cannot be made here."""
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250 + 1}"
    switch = f"arpc{tag}br"
    hosts = [  # interface names: 15 characters at most
        Namespace(f"arpc{tag}n{i}", f"{subnet}.{i + 1}", f"arv{tag}n{i}") for i in range(count)
    ]
    made = [switch]
    try:
        _make_bridge(switch)
        for i, ns in enumerate(hosts):
            made.append(ns.name)
            _plug(ns, switch, f"arv{tag}p{i}")
        yield hosts
    finally:
        for name in made:  # a namespace's interfaces, and their veth peers, go with it
            subprocess.run(
                ["ip", "netns", "del", name], check=False, capture_output=True, timeout=IP_TIMEOUT
            )


def start_in(
    ns: Namespace, command: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``command`` in ``ns`` (``ip netns exec``) from the repository root, in a session
    of its own (:func:`finish` kills the whole process group), output captured, with
    ``env`` added to our environment."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        ["ip", "netns", "exec", ns.name, *command],
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


class Line(NamedTuple):
    """A line of a :class:`Followed` process's output, and when it arrived."""

    at: float  # time.monotonic() when it was read
    stream: str  # "stdout" or "stderr"
    text: str  # without its newline


class Followed:
    """A process from :func:`start_in` whose stdout and stderr are read as they come, a
    thread each, every line kept with the time it arrived: a test can wait for a line
    (:meth:`wait_for`, bounded) while the process runs, and time what happened.
    :func:`finish` takes it as it takes the process."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[Line] = []
        self._arrived = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(stream, pipe), daemon=True)
            for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr))
        ]
        for reader in self._readers:
            reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def _read(self, stream: str, pipe: IO[str] | None) -> None:
        assert pipe is not None  # start_in pipes both
        for text in pipe:
            with self._arrived:
                self.lines.append(Line(time.monotonic(), stream, text.rstrip("\n")))
                self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()  # an output closed: a waiter may give up now

    def _ended(self) -> bool:
        return not any(reader.is_alive() for reader in self._readers)

    def wait_for(self, stream: str, part: str, timeout: float, after: float = 0.0) -> Line:
        """The first line of ``stream`` that contains ``part`` (and arrived after
        ``after``), waiting for it at most ``timeout`` seconds; fails the test, with the
        output so far, if none comes by then or the output ends first."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                for line in self.lines:
                    if line.stream == stream and part in line.text and line.at > after:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self._ended():
                    why = "its output ended" if self._ended() else f"{timeout:.0f}s passed"
                    raise AssertionError(f"no {part!r} on {stream}; {why}:\n{self.output()}")
                self._arrived.wait(left)

    def text(self, stream: str) -> str:
        with self._arrived:
            return "".join(f"{line.text}\n" for line in self.lines if line.stream == stream)

    def output(self) -> str:
        return f"stdout:\n{self.text('stdout')}\nstderr:\n{self.text('stderr')}"

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """As ``Popen.communicate``: wait for the process to exit and its output to end
        (``subprocess.TimeoutExpired`` after ``timeout`` seconds); all it wrote."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        if not self._ended():  # a child of it still holds the output open
            raise subprocess.TimeoutExpired(self.proc.args, timeout or 0.0)
        return self.text("stdout"), self.text("stderr")


def finish(
    procs: Sequence[subprocess.Popen[str] | Followed], timeout: float = JOB_TIMEOUT
) -> list[Worker]:
    """Wait for every process, ``timeout`` seconds for all together; one still running
    then is killed with its process group (what it started too).  Fails unless all
    exit 0; returns them as ``Worker``s, by position."""
    deadline = time.monotonic() + timeout
    workers = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                kill_group(proc)
                out, err = proc.communicate(timeout=IP_TIMEOUT)
                err += f"\n[killed: the job overran {timeout:.0f}s]"
            workers.append(Worker(rank, proc.returncode, out, err))
    finally:
        stop(procs)  # those not waited for: a failure above
    for worker in workers:
        assert worker.returncode == 0, "\n".join(w.describe() for w in workers)
    return workers


def stop(procs: Sequence[subprocess.Popen[str] | Followed]) -> None:
    """Kill each process still running, with its process group, and reap it."""
    for proc in procs:
        if proc.poll() is None:
            kill_group(proc)
            proc.communicate(timeout=IP_TIMEOUT)


def kill_group(proc: subprocess.Popen[str] | Followed) -> None:
    """SIGKILL ``proc``'s process group (it leads one: ``start_new_session``)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_in_namespaces(
    spaces: Sequence[Namespace],
    scenario: str,
    wrap: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> list[Worker]:
    """Rank r of ``scenario`` in ``spaces[r]`` (under ``wrap``, a command prefix; with
    ``env`` added to the environment), the rendezvous at rank 0's address; all bounded
    by JOB_TIMEOUT.  Fails unless all exit 0."""
    port, world = free_port(), len(spaces)
    procs = []
    for rank, ns in enumerate(spaces):
        environ = {RENDEZVOUS_ENV: spaces[0].address, LISTEN_ENV: ns.address, **(env or {})}
        command = [sys.executable, "-m", "tests.worker", scenario, str(rank), str(world)]
        procs.append(start_in(ns, [*wrap, *command, str(port), "uvloop", "tcp"], environ))
    return finish(procs)
