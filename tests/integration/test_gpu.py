"""CUDA tensors across workers (needs a GPU; skipped without one)."""

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
def test_cuda_tensors_through_a_two_process_job() -> None:
    """Echoes, a tensor a side stream is still writing, @batch, an RRef and a backward
    pass, all with CUDA tensors (tests/gpu_scenarios.py)."""
    seen = run_job("gpu_scenarios.cuda_calls", timeout=180)[0].result
    assert seen["echoes"] == [True, True, True]
    device, got, want = seen["side_stream"]
    assert device.startswith("cuda") and got == want  # the send waited for the fill
    assert seen["batch"] is True
    assert seen["rref"][0].startswith("cuda") and seen["rref"][1] == 2000.0
    assert seen["autograd"] is True
