"""CUDA tensors across workers (needs a GPU; skipped without one): ``make test-gpu``."""

from __future__ import annotations

import pytest
import torch

from asyncrpc.serde import allocate_tensor_storage, dumps, loads
from tests.cluster import run_job

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_cuda_tensor_round_trip_keeps_device_and_values() -> None:
    t = torch.randn(1000, 33, device="cuda")[:, 1:]  # non-contiguous, on the GPU
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        t = t * 2  # produced on a side stream: dump must wait for it
        payload, buffers = dumps(t)
    received = []
    for buf in buffers:
        storage, view = allocate_tensor_storage(len(buf))
        view[:] = buf
        received.append(storage)
    back = loads(payload, received)
    assert back.device == t.device
    assert torch.equal(back, t)


@needs_cuda
@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_cuda_tensors_through_a_two_process_job(path: str) -> None:
    """Echoes, a tensor a side stream is still writing, a stream that must not be
    waited for, @batch, an RRef, a backward pass and a RemoteModule trained by a
    DistributedOptimizer, all with CUDA tensors, by CUDA IPC or through pinned host
    memory (tests/gpu_scenarios.py)."""
    env = {"ASYNCRPC_TEST_CUDA_PATH": path}
    seen = run_job("gpu_scenarios.cuda_calls", timeout=240, env=env)[0].result
    assert seen["echoes"] == [True, True, True]
    device, got, want = seen["side_stream"]
    assert device == "cuda:0" and got == want  # the send waited for the fill
    unrelated = seen["unrelated_stream"]
    assert unrelated["equal"] and unrelated["still_busy"], unrelated
    assert seen["batch"] is True
    assert seen["rref"] == ["cuda:0", 2000.0]
    assert seen["autograd"] is True
    assert seen["optimizer"] == {"device": "cuda:0", "equal": True}
    caller, callee = seen["paths"]
    assert caller["paths"] == {"w1": "cuda ipc" if path == "ipc" else "host staging"}
    assert callee["devices"] == ["cuda:0"]  # from w0's map: w1 configured nothing
    sent = "sent_ipc_tensors" if path == "ipc" else "sent_staged_tensors"
    received = "received_ipc_tensors" if path == "ipc" else "received_staged_tensors"
    for stats in (caller, callee):
        assert stats.get(sent, 0) >= 3 and stats.get(received, 0) >= 3, stats
        other = "sent_staged_tensors" if path == "ipc" else "sent_ipc_tensors"
        assert other not in stats, stats


@needs_cuda
def test_bad_device_maps_and_unmapped_tensors_are_refused_with_clear_errors() -> None:
    seen = [w.result for w in run_job("gpu_scenarios.config_errors", timeout=120)]
    count = torch.cuda.device_count()
    for worker in seen:  # every worker refuses the job's maps, with the same words
        assert "worker 'w0' has target devices in its device map for 'w1'" in worker["init"]
        assert f"but worker 'w1' has {count} CUDA device" in worker["init"]
    message = seen[0]["unmapped"]
    assert "cuda:0" in message and "'w1'" in message and "device_maps" in message, message
    assert "call to tests.scenarios.echo" in message, message


@needs_cuda
def test_workers_exit_cleanly_when_peers_held_their_cuda_memory_until_shutdown() -> None:
    """torch frees at exit what a worker sent by CUDA IPC and a peer still held; memory
    a received tensor was copied into then aborts the process (cudaErrorCudartUnloading).
    Shutdown lets go of peers' memory before its last barrier, and frees what was let
    go after it: both exit 0 (run_job checks), with no warning from torch."""
    workers = run_job("gpu_scenarios.exit_right_after_echoes", timeout=120)
    caller, callee = (w.result for w in workers)
    assert caller["received_ipc_tensors"] == callee["sent_ipc_tensors"] == 2  # the case
    assert caller["ipc_kept_bytes"] == callee["ipc_kept_bytes"] == 0  # all let go
    for w in workers:
        assert "terminated before all shared CUDA tensors released" not in w.stderr, w.stderr
