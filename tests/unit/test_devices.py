"""Device maps and CUDA routes: pure logic over device names (no CUDA needed)."""

from __future__ import annotations

import queue
import threading
from collections import Counter
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.serde import cuda
from asyncrpc.serde.cuda import KeptMappings
from asyncrpc.serde.devices import (
    WorkerDevices,
    device_name,
    devices_used,
    normalize_devices,
    normalize_map,
    normalize_maps,
    route,
    validate,
)
from asyncrpc.serde.tensors import load_tensor


def test_devices_are_named_as_torch_names_them() -> None:
    assert device_name(1) == "cuda:1"
    assert device_name("cuda:02") == "cuda:2"
    assert device_name(torch.device("cuda", 3)) == "cuda:3"
    assert device_name("cpu") == "cpu"
    for bad in ("cuda", "gpu:0", -1, True, "cuda:x"):
        with pytest.raises(ValueError, match="device"):
            device_name(bad)


def test_a_map_is_one_to_one_and_names_cuda_devices_only() -> None:
    assert normalize_map({0: 1, "cuda:1": torch.device("cuda:0")}) == {
        "cuda:0": "cuda:1",
        "cuda:1": "cuda:0",
    }
    with pytest.raises(ValueError, match=r"maps both cuda:0 and cuda:1 to cuda:2.*one-to-one"):
        normalize_map({0: 2, 1: 2})
    with pytest.raises(ValueError, match="CUDA devices"):
        normalize_map({"cpu": "cuda:0"})
    assert normalize_maps(None) == {}


def test_devices_list_cuda_devices_once_in_index_order() -> None:
    assert normalize_devices([2, "cuda:0"]) == ("cuda:0", "cuda:2")
    with pytest.raises(ValueError, match="CUDA devices only"):
        normalize_devices(["cpu"])
    with pytest.raises(ValueError, match="twice"):
        normalize_devices([0, "cuda:0"])


def _job(**maps: dict[str, dict[str, str]]) -> dict[str, WorkerDevices]:
    return {
        "w0": WorkerDevices("w0", 2, maps=maps.get("w0", {})),
        "w1": WorkerDevices("w1", 2, maps=maps.get("w1", {})),
        "cpu": WorkerDevices("cpu", 0),
    }


def test_valid_maps_pass() -> None:
    validate(_job(w0={"w1": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}}))


@pytest.mark.parametrize(
    ("job", "words"),
    [
        (_job(w0={"w9": {"cuda:0": "cuda:0"}}), "device map for 'w9', which is not a worker"),
        (_job(w0={"w1": {"cuda:2": "cuda:0"}}), "source devices .* but worker 'w0' has 2 CUDA"),
        (_job(w0={"w1": {"cuda:0": "cuda:5"}}), "target devices .* but worker 'w1' has 2 CUDA"),
        (_job(w0={"cpu": {"cuda:0": "cuda:0"}}), "but worker 'cpu' has no CUDA device"),
        (_job(w1={"w0": {"cuda:0": "cuda:1", "cuda:1": "cuda:1"}}), "maps two devices onto one"),
        (
            {
                "w0": WorkerDevices("w0", 2, ("cuda:0",), {"w1": {"cuda:1": "cuda:0"}}),
                "w1": WorkerDevices("w1", 2),
            },
            "that worker 'w0' does not use: \\['cuda:1'\\]",
        ),
        ({"w0": WorkerDevices("w0", 1, ("cuda:3",))}, "devices \\['cuda:3'\\], but .* 1 CUDA"),
    ],
)
def test_a_bad_map_is_refused_naming_the_worker_and_the_fault(
    job: dict[str, WorkerDevices], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        validate(job)


def test_a_worker_uses_its_devices_or_else_those_the_maps_name() -> None:
    job = _job(w0={"w1": {"cuda:0": "cuda:1"}})
    assert devices_used("w0", job) == ("cuda:0",)
    assert devices_used("w1", job) == ("cuda:1",)  # only others' maps name it
    assert devices_used("cpu", job) == ()
    job["w1"] = WorkerDevices("w1", 2, ("cuda:0", "cuda:1"))
    assert devices_used("w1", job) == ("cuda:0", "cuda:1")


def test_requests_follow_the_callers_map_and_replies_its_inverse() -> None:
    job = _job(w0={"w1": {"cuda:0": "cuda:1"}})
    assert route(job["w0"], job["w1"], reply=False, same_host=False).target("cuda:0") == "cuda:1"
    back = route(job["w1"], job["w0"], reply=True, same_host=False)
    assert back.target("cuda:1") == "cuda:0"
    # A request back (a gradient for the tensor that came) finds the inverse too...
    assert route(job["w1"], job["w0"], reply=False, same_host=False).target("cuda:1") == "cuda:0"
    # ...unless the callee's own map names the device: for requests, its own map rules.
    job["w1"] = WorkerDevices("w1", 2, maps={"w0": {"cuda:1": "cuda:1"}})
    assert route(job["w1"], job["w0"], reply=False, same_host=False).target("cuda:1") == "cuda:1"
    assert route(job["w1"], job["w0"], reply=True, same_host=False).target("cuda:1") == "cuda:0"


def test_an_unmapped_cuda_tensor_is_refused_naming_peer_call_and_fix() -> None:
    job = _job(w0={"w1": {"cuda:0": "cuda:1"}})
    way = route(job["w0"], job["w1"], reply=False, same_host=False).named("call to f")
    with pytest.raises(SerializationError) as caught:
        way.target("cuda:1")
    text = str(caught.value)
    assert "cuda:1" in text and "call to f" in text and "'w1'" in text
    assert "device_maps={'w1'" in text and "on worker 'w0'" in text
    assert caught.value.details["worker"] == "w1"


def test_a_call_to_oneself_keeps_every_device_and_never_uses_ipc() -> None:
    me = WorkerDevices("w0", 2, gpus={"cuda:0": "GPU-a"})
    way = route(me, me, reply=False, same_host=True)
    assert way.target("cuda:1") == "cuda:1" and not way.ipc


def test_ipc_needs_the_same_host_and_a_gpu_the_peer_sees() -> None:
    w0 = WorkerDevices(
        "w0",
        2,
        maps={"w1": {"cuda:0": "cuda:0", "cuda:1": "cuda:1"}},
        gpus={"cuda:0": "GPU-a", "cuda:1": "GPU-b"},
    )
    w1 = WorkerDevices("w1", 1, gpus={"cuda:0": "GPU-b"})  # sees only the second GPU
    assert route(w0, w1, reply=False, same_host=True).ipc == {"cuda:1"}
    assert route(w0, w1, reply=False, same_host=False).ipc == frozenset()


def test_published_devices_round_trip_and_anything_else_means_none() -> None:
    w = WorkerDevices("w0", 2, ("cuda:1",), {"w1": {"cuda:1": "cuda:0"}})
    assert WorkerDevices.from_dict("w0", w.to_dict()) == w
    assert WorkerDevices.from_dict("old", None) == WorkerDevices("old", 0)


def test_the_latest_storage_of_each_peer_segment_stays_open_for_a_while() -> None:
    kept = KeptMappings(max_kept=2, max_bytes=100, keep_for=1.0)
    assert kept.keep(None, "unsegmented", 10, 0.0) == ["unsegmented"]
    assert kept.keep("s1", "big", 101, 0.0) == ["big"]  # more than max_bytes: let go
    assert kept.keep("s1", "a", 10, 0.0) == []
    assert kept.keep("s1", "b", 10, 0.1) == ["a"]  # the newer of a segment replaces it
    assert kept.keep("s2", "c", 10, 0.2) == []
    assert kept.keep("s3", "d", 10, 0.3) == ["b"]  # at most max_kept: the oldest goes
    assert kept.expired(1.1) == []
    assert kept.expired(1.25) == ["c"]
    assert kept.keep("s4", "e", 10, 1.4) == ["d"]  # (stale ones go with any new one)
    assert kept.keep("s5", "f", 95, 1.5) == ["e"]  # at most max_bytes in all
    assert (len(kept), kept.kept_bytes) == (1, 95)


class Copied:
    """A CUDA copy's event that has fired (what the releaser waits for)."""

    def synchronize(self) -> None:
        pass


def test_letting_go_of_peers_frees_every_kept_storage_after_the_copies_queued_before(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What a worker leaving the job runs before its last barrier (see
    test_gpu.test_workers_exit_cleanly_when_peers_held_their_cuda_memory_until_shutdown):
    the releaser thread lets go of the storages it keeps and of those still queued, in
    order, then says so.  Fakes stand for the copies' events and the release stream."""
    monkeypatch.setattr(cuda, "_release_queue", None)
    assert cuda.let_go_of_peers() is None  # no peer ever shared any memory

    kept = KeptMappings(keep_for=60.0)
    jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
    # (it stays parked on this queue, as the worker's own does on its queue)
    threading.Thread(target=cuda._release_forever, args=(jobs, kept), daemon=True).start()
    held = [["storage a"], ["storage b"]]
    jobs.put((Copied(), held[0], None, "segment a", 10))
    jobs.put((Copied(), held[1], None, "segment b", 10))
    monkeypatch.setattr(cuda, "_release_queue", jobs)
    released = cuda.let_go_of_peers()
    assert released is not None and released.result(timeout=10) is None
    assert held == [[], []]  # (each storage's last reference, dropped by the releaser)
    assert (len(kept), kept.kept_bytes) == (0, 0)
    abandoned = cuda.let_go_of_peers()  # a waiter that gave up (a shutdown timed out)
    assert abandoned is not None and abandoned.cancel()
    after = cuda.let_go_of_peers()
    assert after is not None and after.result(timeout=10) is None
    assert not [r for r in caplog.records if r.name == "asyncrpc.cuda"]  # (no error)


def test_a_failed_release_is_logged_and_the_releaser_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job that fails (a CUDA error, say) must not end the thread: the jobs after it
    still run, and a waiter of let_go_of_peers is woken even when letting go failed."""

    class Failed:  # a copy's event whose wait fails
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    class Unreleasable:  # a kept storage whose release fails
        def clear(self) -> None:
            raise RuntimeError("CUDA error: invalid resource handle")

    kept = KeptMappings(keep_for=60.0)
    jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
    threading.Thread(target=cuda._release_forever, args=(jobs, kept), daemon=True).start()
    jobs.put((Failed(), ["storage a"], None, "segment a", 10))
    jobs.put((Copied(), Unreleasable(), None, "segment b", 10))
    released: Future[None] = Future()
    jobs.put(released)
    assert released.result(timeout=10) is None
    held = ["storage c"]
    jobs.put((Copied(), held, None, "segment c", 10))
    again: Future[None] = Future()
    jobs.put(again)
    assert again.result(timeout=10) is None
    assert held == []  # the thread still works
    failures = [r.getMessage() for r in caplog.records if r.name == "asyncrpc.cuda"]
    assert failures == ["letting go of a peer's CUDA memory failed"] * 2, failures


def test_only_a_worker_that_sent_by_cuda_ipc_collects_and_a_failure_is_only_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A CPU worker never touches CUDA as it closes; a CUDA error there must not stop
    the close."""
    collected: list[bool] = []

    def ipc_collect() -> None:
        collected.append(True)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "ipc_collect", ipc_collect)
    monkeypatch.setattr(cuda, "_counts", Counter())
    cuda.collect_released()
    assert collected == []  # never sent any: CUDA is left alone
    monkeypatch.setattr(cuda, "_counts", Counter(sent_ipc_tensors=1))
    cuda.collect_released()  # (does not raise)
    assert collected == [True]
    assert [r.getMessage() for r in caplog.records if r.name == "asyncrpc.cuda"] == [
        "freeing the CUDA memory peers let go of failed"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a worker without CUDA")
def test_a_tensor_for_a_device_this_worker_lacks_is_refused_naming_it() -> None:
    meta = ("float32", (2,), (1,), False, "cuda:0", False)
    with pytest.raises(SerializationError, match="device 'cuda:0', which this worker lacks"):
        load_tensor(meta, bytearray(8))
