"""Device maps: which device a tensor lands on at the other end, decided before it leaves.

Theory of operation
-------------------
A device map says, for one peer, where a tensor on each of this worker's devices
lands there: ``{"cuda:0": "cuda:1"}``, as in torch's
``TensorPipeRpcBackendOptions.set_device_map``.  Maps are one-to-one (a reply
travels back by the inverse) and name devices as torch does (an int ``i`` is
``cuda:i``).  Every worker publishes its maps at rendezvous, so each knows both
directions of every pair and checks them all, as torch does, before a call is made:
an unknown worker, a device index a worker lacks, a device outside a worker's
``devices``, or two devices mapped onto one is a ``ValueError`` naming the
worker and the map.

A message's :class:`CudaRoute` is what the sender needs to place its tensors.  A
*request* follows the caller's own map to the callee (torch's rule); a device
that map does not name follows the inverse of the callee's map to the caller, if
that names it (so a gradient goes back to where its tensor came from).  A
*reply* is the mirror image: the inverse of the caller's map first, the callee's
own map second.  A CUDA tensor on a device that neither names is an error raised
before anything is sent, naming the worker, the call and the way to fix it.  A
CPU tensor always lands on the CPU (maps name CUDA devices only).

Which devices a worker handles (and so initialises CUDA for) are those it lists
in ``devices``, or else every device its own maps and the maps towards it name
(torch's rule).  This module is pure logic over device *names*: no CUDA is
needed to test it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncrpc.errors import SerializationError

DeviceMap = dict[str, str]


def device_name(device: Any) -> str:
    """torch's name of a device given as an int (a CUDA index), a str or a torch.device:
    ``"cuda:1"``, ``"cpu"``.  A CUDA device must carry its index."""
    if isinstance(device, bool):
        raise ValueError(f"{device!r} is not a device")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index {device} is negative")
        return f"cuda:{device}"
    text = str(device)
    kind, colon, index = text.partition(":")
    if kind == "cpu" and not colon:
        return "cpu"
    if kind == "cuda" and colon and index.isdigit():
        return f"cuda:{int(index)}"
    raise ValueError(f"{device!r} is not a device asyncrpc maps: use 'cpu' or 'cuda:<index>'")


def normalize_map(device_map: Mapping[Any, Any]) -> DeviceMap:
    """``device_map`` with torch's device names; a ``ValueError`` if two devices map onto
    one (a reply could not find its way back)."""
    normal: DeviceMap = {}
    back: DeviceMap = {}
    for source, target in device_map.items():
        here, there = device_name(source), device_name(target)
        if "cpu" in (here, there):
            raise ValueError(
                f"device_map entry {source!r}: {target!r}: maps name CUDA devices (a CPU "
                "tensor always lands on the CPU)"
            )
        if there in back:
            raise ValueError(
                f"device_map maps both {back[there]} and {here} to {there}: a map must be "
                "one-to-one, so that replies can travel by its inverse"
            )
        normal[here], back[there] = there, here
    return normal


def normalize_maps(device_maps: Mapping[str, Mapping[Any, Any]] | None) -> dict[str, DeviceMap]:
    """Every peer's map normalised (``init_rpc(device_maps=...)``)."""
    return {str(peer): normalize_map(m) for peer, m in (device_maps or {}).items()}


def normalize_devices(devices: Iterable[Any] | None) -> tuple[str, ...]:
    """``init_rpc(devices=...)``: CUDA devices only, each once."""
    names = [device_name(d) for d in devices or ()]
    if any(not n.startswith("cuda:") for n in names):
        raise ValueError(f"devices={list(devices or ())}: list CUDA devices only")
    if len(set(names)) != len(names):
        raise ValueError(f"devices={names} names a device twice")
    return tuple(sorted(names, key=_index))


def _index(name: str) -> int:
    return int(name.partition(":")[2] or 0)


def inverse(device_map: Mapping[str, str]) -> DeviceMap:
    return {there: here for here, there in device_map.items()}


@dataclass(frozen=True, slots=True)
class WorkerDevices:
    """What a worker publishes about its devices at rendezvous."""

    name: str
    device_count: int  # CUDA devices it sees (0: none, or CUDA not available)
    devices: tuple[str, ...] = ()  # as configured (empty: derived from the maps)
    maps: Mapping[str, DeviceMap] = field(default_factory=dict)  # peer -> its map there
    gpus: Mapping[str, str] = field(default_factory=dict)  # device -> its GPU's UUID

    def to_dict(self) -> dict[str, Any]:
        """The part of a rendezvous record (the GPUs are published later, by CUDA jobs)."""
        return {"count": self.device_count, "devices": list(self.devices), "maps": self.maps}

    @classmethod
    def from_dict(cls, name: str, data: Any) -> WorkerDevices:
        """What ``to_dict`` made (anything else: a worker with no CUDA device)."""
        if not isinstance(data, dict):
            return cls(name, 0)
        maps = {str(p): {str(k): str(v) for k, v in m.items()} for p, m in data["maps"].items()}
        return cls(name, int(data["count"]), tuple(map(str, data["devices"])), maps)


def validate(workers: Mapping[str, WorkerDevices]) -> None:
    """Check every worker's devices and maps, as torch does at init; ``ValueError``
    naming the worker, the map and what is wrong."""
    for worker in workers.values():
        _check_count(worker.name, worker, worker.devices, "devices")
    for source in workers.values():
        for peer, device_map in source.maps.items():
            target = workers.get(peer)
            if target is None:
                raise ValueError(
                    f"worker {source.name!r} has a device map for {peer!r}, which is not a "
                    f"worker of this job (workers: {', '.join(sorted(workers))})"
                )
            where = f"in its device map for {peer!r} ({device_map})"
            _check_side(source.name, source, device_map.keys(), f"source devices {where}")
            _check_side(source.name, target, device_map.values(), f"target devices {where}")
            if len(set(device_map.values())) != len(device_map):
                raise ValueError(f"worker {source.name!r} maps two devices onto one {where}")


def _check_side(owner: str, holder: WorkerDevices, names: Iterable[str], what: str) -> None:
    """Worker ``owner``'s map names ``names`` (``what``) on worker ``holder``: each must
    be among ``holder``'s devices, if it lists them, and a device it has."""
    names = list(names)
    if holder.devices:
        outside = sorted(set(names) - set(holder.devices))
        if outside:
            raise ValueError(
                f"worker {owner!r} has {what} that worker {holder.name!r} does not use: "
                f"{outside} (its devices: {list(holder.devices)})"
            )
    _check_count(owner, holder, names, what)


def _check_count(owner: str, holder: WorkerDevices, names: Iterable[str], what: str) -> None:
    """Worker ``owner`` names ``names`` (``what``) on worker ``holder``, which must have
    each of those device indices."""
    count = holder.device_count
    missing = sorted(n for n in names if _index(n) >= count)
    if missing:
        has = f"{count} CUDA device{'s' if count != 1 else ''}" if count else "no CUDA device"
        raise ValueError(
            f"worker {owner!r} has {what} {missing}, but worker {holder.name!r} has {has}"
        )


def devices_used(name: str, workers: Mapping[str, WorkerDevices]) -> tuple[str, ...]:
    """The CUDA devices worker ``name`` handles: its ``devices``, or else every device
    its maps and the maps towards it name (torch's rule)."""
    me = workers[name]
    if me.devices:
        return me.devices
    used = {d for m in me.maps.values() for d in m}
    towards = [m for w in workers.values() for peer, m in w.maps.items() if peer == name]
    used |= {d for m in towards for d in m.values()}
    return tuple(sorted(used, key=_index))


@dataclass(frozen=True, slots=True)
class CudaRoute:
    """Where the tensors of one message land, and how they may travel.

    ``devices`` maps this worker's devices to the peer's; ``ipc`` names the devices
    here whose memory the peer can open by CUDA IPC (same host, and it sees that
    GPU); ``what`` names the message in errors ("call to f on worker 'w1'").
    """

    peer: str
    devices: Mapping[str, str]
    ipc: frozenset[str] = frozenset()
    what: str = ""
    hint: str = ""  # how to configure a missing entry, for the error
    same_process: bool = False  # a call to oneself: every device stays as it is

    def target(self, device: str) -> str:
        """The device a tensor on ``device`` lands on; SerializationError if none."""
        found = self.devices.get(device)
        if found is not None:
            return found
        if self.same_process:
            return device
        raise SerializationError(
            f"cannot send a tensor on {device} in the {self.what or 'message'}: no device "
            f"map takes {device} to worker {self.peer!r}. {self.hint}",
            worker=self.peer,
            device=device,
        )

    def named(self, what: str) -> CudaRoute:
        """The same route, naming the message ``what`` in its errors."""
        return CudaRoute(self.peer, self.devices, self.ipc, what, self.hint, self.same_process)


def route(me: WorkerDevices, peer: WorkerDevices, *, reply: bool, same_host: bool) -> CudaRoute:
    """The route of a request (``reply=False``) or a reply from ``me`` to ``peer``;
    ``same_host``: the two may share memory (same kernel, PID namespace and user), so
    a device here whose GPU the peer sees travels by CUDA IPC."""
    if me.name == peer.name:
        return CudaRoute(peer.name, {}, same_process=True)  # (no IPC within a process)
    mine = dict(me.maps.get(peer.name, {}))
    theirs = inverse(peer.maps.get(me.name, {}))
    first, second = (theirs, mine) if reply else (mine, theirs)
    merged = {**second, **first}
    hint = (
        f"Give init_rpc(device_maps={{{peer.name!r}: {{'<device here>': '<device there>'}}}}) "
        f"on worker {me.name!r}, or move the tensor to the CPU first"
    )
    seen_there = set(peer.gpus.values())
    ipc = frozenset(
        d for d, uuid in me.gpus.items() if same_host and uuid in seen_there and d in merged
    )
    return CudaRoute(peer.name, merged, ipc, hint=hint)
