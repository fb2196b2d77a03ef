"""The physical floor of a cold large transfer on this machine, measured without RPC.

A process's first transfer of a large tensor lands in memory that nobody has touched
yet, and every page of it must be faulted in (allocated and zeroed by the kernel)
before or while the bytes are copied in.  That, not the framework, sets the floor of
a cold echo (``bench_rpc.py``'s first 400 MB echo of a fresh pair): the request lands
in fresh memory on the callee, the reply in fresh memory on the caller.  This script
measures, for one buffer size:

* ``fresh segment``: copying into a new memfd mapping, as asyncrpc's sender does into
  a segment it has just created (shared-memory page faults);
* ``map + populate``: the receiver's ``MAP_POPULATE`` of that segment;
* ``warm segment``: the same copy into a segment already faulted in (every later
  transfer through a reused segment);
* ``socket -> fresh``: another process sends the bytes through a Unix socket into a
  fresh ``torch.empty`` (what a socket transport pays);
* ``process_vm_readv -> fresh``: the receiver copies straight out of the sender's
  memory into a fresh ``torch.empty`` (one copy, as cross-memory-attach transports do;
  skipped where the kernel refuses it).

Each is the median of ``--repeats`` fresh tries, printed with every try.  Usage:
``python benchmarks/cold_floor.py [--mb 400] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch

from asyncrpc.transport.shm import _Mapping

libc = ctypes.CDLL(None, use_errno=True)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


libc.process_vm_readv.restype = ctypes.c_ssize_t
libc.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(IoVec),
    ctypes.c_ulong,
    ctypes.POINTER(IoVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def segment_copies(source: torch.Tensor) -> dict[str, float]:
    """Fresh and warm copies into one new segment, and a receiver's populate (mapped
    as asyncrpc maps segments)."""
    nbytes = source.numel() * source.element_size()
    fd = os.memfd_create("cold-floor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        sender = _Mapping(fd, nbytes, populate=False)
        fresh = timed(lambda: ctypes.memmove(sender.address, source.data_ptr(), nbytes))
        warm = timed(lambda: ctypes.memmove(sender.address, source.data_ptr(), nbytes))
        receiver: list[_Mapping] = []  # alive until the end: its unmap is not timed
        mapped = timed(lambda: receiver.append(_Mapping(fd, nbytes, populate=True)))
    finally:
        os.close(fd)
    return {"fresh segment": fresh, "map + populate": mapped, "warm segment": warm}


def from_another_process(nbytes: int) -> dict[str, float]:
    """A child holds the bytes; this process lands them in fresh memory, twice."""
    ours, theirs = socket.socketpair()
    address_in, address_out = os.pipe()
    child = os.fork()
    if child == 0:  # the sender: its tensor's address, then the bytes through the socket
        ours.close()
        data = torch.ones(nbytes // 4)
        os.write(address_out, data.data_ptr().to_bytes(8, "little"))
        theirs.recv(1)
        theirs.sendall(memoryview(data.numpy()).cast("B"))
        theirs.recv(1)
        os._exit(0)
    theirs.close()
    try:
        address = int.from_bytes(os.read(address_in, 8), "little")
        results = {"process_vm_readv -> fresh": _pull(child, address, nbytes)}
        ours.send(b"go")
        results["socket -> fresh"] = timed(lambda: _receive(ours, nbytes))
        ours.send(b"done")
    finally:
        os.waitpid(child, 0)
        os.close(address_in)
        os.close(address_out)
        ours.close()
    return results


def _pull(pid: int, address: int, nbytes: int) -> float:
    start = time.perf_counter()
    landing = torch.empty(nbytes // 4)
    local, remote = IoVec(landing.data_ptr(), nbytes), IoVec(address, nbytes)
    copied = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    elapsed = time.perf_counter() - start
    return elapsed if copied == nbytes else float("nan")  # refused (ptrace policy)


def _receive(sock: socket.socket, nbytes: int) -> None:
    landing = torch.empty(nbytes // 4)
    view = memoryview(landing.numpy()).cast("B")
    received = 0
    while received < nbytes:
        received += sock.recv_into(view[received:], min(nbytes - received, 1 << 20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400, help="buffer size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    nbytes = args.mb << 20
    source = torch.ones(nbytes // 4)
    tries: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, seconds in {**segment_copies(source), **from_another_process(nbytes)}.items():
            tries.setdefault(name, []).append(seconds * 1e3)
    print(f"{args.mb} MiB, {args.repeats} fresh tries each (ms), load {os.getloadavg()[0]:.2f}")
    for name, ms in tries.items():
        each = " ".join(f"{m:.0f}" for m in ms)
        print(f"  {name:28s} median {statistics.median(ms):7.1f}   [{each}]")
    landing = min(
        statistics.median(tries[k]) for k in ("socket -> fresh", "process_vm_readv -> fresh")
    )
    print(f"a cold echo lands twice in fresh memory: floor about {2 * landing:.0f} ms")


if __name__ == "__main__":
    main()
