"""asyncrpc.compat's own checks: what torch's suite does not pin down (two workers, fork)."""

from __future__ import annotations

import multiprocessing
import pickle
import tempfile
from typing import Any

import pytest
import torch

import asyncrpc
import asyncrpc.compat.autograd as dist_autograd
from asyncrpc.compat import rpc

WORLD = 2


def add(a: Any, b: Any) -> Any:
    return a + b


def sleep_a_bit(seconds: float) -> None:
    import time

    time.sleep(seconds)  # the callee is slow on purpose: the caller's timeout passes


async def blocks_on_loop() -> Any:
    return rpc.rpc_sync("w0", add, args=(1, 2))  # on the loop thread: must raise


@rpc.functions.async_execution
def chained(to: str) -> torch.futures.Future[Any]:
    return rpc.rpc_async(to, add, args=(1, 2)).then(lambda fut: fut.wait() + 1)


def nested_to_here(rref: rpc.RRef[Any]) -> Any:
    return rref.to_here() + rpc.rpc_sync(rref.owner(), add, args=(1, 1))


def grad_in_nested_call(t: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync("w0", torch.mul, args=(t, 2))


def checks() -> dict[str, Any]:
    """Run on w0; returns what each check saw."""
    seen: dict[str, Any] = {}
    seen["future"] = rpc.rpc_async("w1", add, args=(1, 2)).then(lambda f: f.wait() * 10).wait()
    seen["wait_all"] = [
        f.wait()
        for f in torch.futures.collect_all(
            [rpc.rpc_async("w1", add, args=(i, 1)) for i in range(3)]
        ).wait()
    ]
    with pytest.raises(RuntimeError, match="event loop thread"):
        rpc.rpc_sync("w1", blocks_on_loop)
    seen["async_execution"] = rpc.rpc_sync("w1", chained, args=("w0",))
    with pytest.raises(rpc.RPCTimeoutError) as timed_out:
        rpc.rpc_sync("w1", sleep_a_bit, args=(1.0,), timeout=0.2)
    seen["timeout_types"] = isinstance(timed_out.value, RuntimeError) and isinstance(
        timed_out.value, asyncrpc.RPCTimeoutError
    )
    rpc.rpc_sync("w1", sleep_a_bit, args=(0.3,), timeout=0)  # 0: no deadline
    with pytest.raises(RuntimeError):
        rpc.rpc_sync("nobody", add, args=(1, 2))
    with pytest.raises(TypeError, match="failed to match any schema") as no_schema:
        rpc.rpc_sync("w1", torch.add, args=())  # an operator: torch's RuntimeError too
    seen["operator_error"] = isinstance(no_schema.value, RuntimeError)
    rref = rpc.remote("w1", add, args=(torch.ones(2), 1))
    seen["rref"] = (type(rref) is rpc.RRef, rref.to_here().tolist(), rref.owner_name())
    mine = rpc.RRef(torch.zeros(1))
    seen["nested_to_here"] = rpc.rpc_sync("w1", nested_to_here, args=(mine,)).tolist()
    info = rpc.get_worker_info("w1")
    seen["worker_info"] = (
        info == rpc.WorkerInfo("w1", 1),
        hash(info) == hash(rpc.WorkerInfo("w1", 1)),
        pickle.loads(pickle.dumps(info)) == info,
    )
    with pytest.raises(RuntimeError):
        rpc.WorkerInfo("bad name!", 0)
    x = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync("w1", grad_in_nested_call, args=(x,))
        dist_autograd.backward(context_id, [y.sum()])
        seen["grad"] = dist_autograd.get_gradients(context_id)[x].tolist()
    for _ in range(3):  # torch's private barrier; each round is forgotten once passed
        rpc.api._barrier(["w0"])
    seen["barrier_rounds_kept"] = len(rpc.api._arrived) + len(rpc.api._left)
    return seen


def _worker(rank: int, init_file: str, results: Any) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}", rpc_timeout=20)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=WORLD, rpc_backend_options=options)
    try:
        outcome: Any = checks() if rank == 0 else None
    except BaseException as exc:  # reported to the test, which fails with it
        outcome = repr(exc)
    rpc.shutdown()
    results.put((rank, outcome))


def test_compat_api_on_two_workers() -> None:
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    with tempfile.NamedTemporaryFile() as init_file:
        workers = [
            context.Process(target=_worker, args=(rank, init_file.name, results))
            for rank in range(WORLD)
        ]
        for worker in workers:
            worker.start()
        outcomes = dict(results.get(timeout=60) for _ in workers)
        for worker in workers:
            worker.join(30)
    assert [worker.exitcode for worker in workers] == [0, 0]
    seen = outcomes[0]
    assert isinstance(seen, dict), seen
    assert seen["future"] == 30
    assert seen["wait_all"] == [1, 2, 3]
    assert seen["async_execution"] == 4
    assert seen["timeout_types"]
    assert seen["operator_error"]
    assert seen["rref"] == (True, [2.0, 2.0], "w1")
    assert seen["nested_to_here"] == [2.0]
    assert seen["worker_info"] == (True, True, True)
    assert seen["grad"] == [2.0, 2.0]
    assert seen["barrier_rounds_kept"] == 0


def test_blocking_call_without_init_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"^RPC has not been initialized"):
        rpc.rpc_sync("w1", add, args=(1, 2))
