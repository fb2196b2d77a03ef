"""``@batch`` over real loopback links between agents on one loop: how batches form,
where they run, and how each caller's outcome reaches it."""

from __future__ import annotations

import asyncio
import pickle
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from asyncrpc import AgentStateError, OverloadedError, RPCTimeoutError, autograd
from asyncrpc.agent import AgentOptions, RpcAgent, set_default_agent
from asyncrpc.autograd.context import contexts_of, current_context_id
from asyncrpc.functions import batch
from asyncrpc.serving import BatchedFunction
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(30)
LONG = 30.0  # a max_wait no test waits out: the batch must form by size


class Seen:
    """What the batched functions below observe (fresh for every test)."""

    batches: list[list[Any]]
    threads: list[int]
    contexts: list[Any]
    gate: asyncio.Event
    entered: asyncio.Event


@pytest.fixture(autouse=True)
def seen() -> None:
    Seen.batches, Seen.threads, Seen.contexts = [], [], []
    Seen.gate, Seen.entered = asyncio.Event(), asyncio.Event()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[RpcAgent, RpcAgent]]:
    async with joined_agents("ab", AgentOptions(transports=("unix",), rpc_timeout=10)) as agents:
        yield agents[0], agents[1]


def _record(items: list[Any]) -> None:
    Seen.batches.append(list(items))
    Seen.threads.append(threading.get_ident())
    Seen.contexts.append(current_context_id.get())


@batch(max_size=4, max_wait=LONG)
def double(items: list[int]) -> list[int]:
    _record(items)
    return [2 * item for item in items]


@batch(max_size=100, max_wait=0.05)
async def square(items: list[int]) -> list[int]:
    _record(items)
    return [item * item for item in items]


@batch(max_size=4, max_wait=LONG)
def fails_on_negative(items: list[int]) -> list[Any]:
    return [ValueError(f"negative: {i}") if i < 0 else i for i in items]


@batch(max_size=3, max_wait=LONG)
def raises(items: list[int]) -> list[int]:
    raise KeyError(f"model broke on a batch of {len(items)}")


@batch(max_size=2, max_wait=LONG)
def too_short(items: list[int]) -> list[int]:
    return items[:1]


@batch(max_size=2, max_wait=LONG, max_queue=3)
def small_queue(items: list[int]) -> list[int]:
    _record(items)
    return items


@batch(max_size=2, max_wait=LONG)
async def gated(items: list[int]) -> list[int]:
    _record(items)
    Seen.entered.set()
    await Seen.gate.wait()
    return items


W = torch.linspace(-1.0, 1.0, 16, dtype=torch.float64).reshape(4, 4).requires_grad_()


@batch(max_size=2, max_wait=LONG)
def project(items: list[torch.Tensor]) -> torch.Tensor:
    _record(items)
    return torch.stack(items) @ W  # row i depends on item i only


@batch(max_size=8, max_wait=0.0)
def rows(items: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(items) * 10  # one result per row


async def test_a_batch_forms_when_max_size_items_wait(pair: tuple[RpcAgent, RpcAgent]) -> None:
    a, b = pair
    results = await asyncio.gather(*(a.rpc_async("b", double, (i,)) for i in range(8)))
    assert results == [2 * i for i in range(8)]
    assert sorted(map(len, Seen.batches)) == [4, 4]  # max_wait is never waited out
    assert sorted(i for batch_ in Seen.batches for i in batch_) == list(range(8))
    assert double.stats() == {}  # figures are per worker: the caller ran no batch
    assert b.debug_info()["batched_functions"][double.rpc_name]["sizes"] == {4: 2}


async def test_a_batch_forms_when_the_oldest_item_waited_max_wait(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await asyncio.gather(*(a.rpc_async("b", square, (i,)) for i in range(3))) == [0, 1, 4]
    assert loop.time() - started >= 0.05
    assert Seen.batches == [[0, 1, 2]]


async def test_a_plain_function_runs_in_the_pool_and_an_async_one_on_the_loop(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    await asyncio.gather(*(a.rpc_async("b", double, (i,)) for i in range(4)))
    await a.rpc_async("b", square, (1,))
    assert Seen.threads[0] != threading.get_ident()
    assert Seen.threads[1] == threading.get_ident()


async def test_an_exception_in_a_slot_fails_only_that_caller(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    outcomes = await asyncio.gather(
        *(a.rpc_async("b", fails_on_negative, (i,)) for i in (1, -2, 3, 4)),
        return_exceptions=True,
    )
    assert outcomes[0] == 1 and outcomes[2:] == [3, 4]
    assert isinstance(outcomes[1], ValueError)
    assert str(outcomes[1]) == "negative: -2"


async def test_an_exception_raised_by_the_function_fails_every_caller_of_the_batch(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    outcomes = await asyncio.gather(
        *(a.rpc_async("b", raises, (i,)) for i in range(3)), return_exceptions=True
    )
    for outcome in outcomes:
        assert isinstance(outcome, KeyError)
        assert "model broke on a batch of 3" in str(outcome)
        assert outcome.remote_worker == "b"  # type: ignore[attr-defined]
        assert "in raises" in outcome.remote_traceback  # type: ignore[attr-defined]


async def test_a_result_of_the_wrong_length_fails_every_caller_naming_the_function(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    outcomes = await asyncio.gather(
        *(a.rpc_async("b", too_short, (i,)) for i in range(2)), return_exceptions=True
    )
    for outcome in outcomes:
        assert isinstance(outcome, ValueError)
        assert "too_short returned 1 results for a batch of 2 items" in str(outcome)


async def test_a_caller_that_timed_out_is_dropped_from_a_batch_not_yet_started(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    with pytest.raises(RPCTimeoutError):
        await a.rpc_async("b", double, (100,), timeout=0.05)
    # its CANCEL went ahead of these on the same link: the batch holds only them
    assert await asyncio.gather(*(a.rpc_async("b", double, (i,)) for i in range(4))) == [
        0,
        2,
        4,
        6,
    ]
    assert Seen.batches == [[0, 1, 2, 3]]
    assert b.debug_info()["batched_functions"][double.rpc_name]["waiting"] == 0


async def test_a_full_queue_refuses_at_once_and_loses_nothing_it_accepted(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    Seen.entered.clear()
    accepted = [a.rpc_async("b", small_queue, (i,)) for i in range(3)]  # batch of 2; 1 waits
    refused = [a.rpc_async("b", small_queue, (i,)) for i in range(3, 6)]  # 3 wait: full
    outcomes = await asyncio.gather(*refused, return_exceptions=True)
    assert sum(isinstance(o, OverloadedError) for o in outcomes) >= 1
    for outcome in outcomes:
        if isinstance(outcome, OverloadedError):
            assert "small_queue is overloaded" in str(outcome)
            assert outcome.details["max_queue"] == 3
    waiting = [o for o in outcomes if not isinstance(o, OverloadedError)]
    # whatever was queued completes once another item fills its batch
    fillers = [a.rpc_async("b", small_queue, (i,)) for i in range(6, 6 + 1 + len(waiting) % 2)]
    done = await asyncio.gather(*accepted, *fillers)
    assert done[:3] == [0, 1, 2]
    assert sorted(i for batch_ in Seen.batches for i in batch_) == sorted(
        [0, 1, 2, *waiting, *range(6, 6 + len(fillers))]
    )


async def test_items_arriving_while_a_batch_runs_form_the_next_batch(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    first = [a.rpc_async("b", gated, (i,)) for i in range(2)]
    await Seen.entered.wait()
    later = [a.rpc_async("b", gated, (i,)) for i in range(2, 6)]
    while _waiting(pair[1], gated) < 4:  # bounded by the test's timeout
        await asyncio.sleep(0.005)
    assert len(Seen.batches) == 1  # max_concurrent=1: the others wait their turn
    Seen.gate.set()
    assert await asyncio.gather(*first, *later) == list(range(6))
    assert Seen.batches == [[0, 1], [2, 3], [4, 5]]


def _waiting(agent: RpcAgent, fn: BatchedFunction[Any, Any]) -> int:
    stats = agent.debug_info().get("batched_functions", {}).get(fn.rpc_name, {})
    return int(stats.get("waiting", 0))


async def test_a_tensor_result_gives_each_caller_its_row(pair: tuple[RpcAgent, RpcAgent]) -> None:
    a, _ = pair
    inputs = [torch.full((3,), float(i)) for i in range(5)]
    outputs = await asyncio.gather(*(a.rpc_async("b", rows, (x,)) for x in inputs))
    for x, y in zip(inputs, outputs, strict=True):
        assert torch.equal(y, x * 10)
        assert y.untyped_storage().nbytes() == 3 * 4  # its row only, not the batch


async def test_the_batch_runs_in_no_callers_autograd_context(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    token = current_context_id.set(12345)
    try:
        calls = [a.rpc_async("b", double, (i,)) for i in range(4)]
    finally:
        current_context_id.reset(token)
    assert await asyncio.gather(*calls) == [0, 2, 4, 6]
    assert Seen.contexts == [None]


async def test_gradients_flow_back_through_a_batch_to_each_caller_for_its_own_slot(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    contexts_of(a), contexts_of(b)  # (init_rpc does this)
    set_default_agent(a)
    try:
        got = await asyncio.gather(_train_through(a, b, 1), _train_through(a, b, 2))
    finally:
        set_default_agent(None)
    assert [len(items) for items in Seen.batches] == [2]  # both callers in one batch
    for seed, (grad_w_a, grad_w) in zip((1, 2), got, strict=True):
        w_a, x = _inputs(seed)
        w_local = W.detach().clone().requires_grad_()
        ((x @ w_a @ w_local) ** 2).sum().backward()
        assert torch.allclose(grad_w_a, w_a.grad)  # type: ignore[arg-type]
        assert torch.allclose(grad_w, w_local.grad)  # type: ignore[arg-type]


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w_a = torch.randn(3, 4, dtype=torch.float64, generator=generator).requires_grad_()
    return w_a, torch.randn(3, 3, dtype=torch.float64, generator=generator)


async def _train_through(a: RpcAgent, b: RpcAgent, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A caller's step in its own context: forward through the batch, backward; its
    gradients for its own weights (here) and for the batch's weights (on b)."""
    w_a, x = _inputs(seed)
    async with autograd.context() as ctx:
        y = await a.rpc_async("b", project, (x @ w_a,))
        await autograd.backward(ctx, [(y * y).sum()])
        return autograd.get_gradients(ctx)[w_a], contexts_of(b).get(ctx).grads[W]


async def test_waiting_callers_fail_when_the_serving_worker_shuts_down(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    _, b = pair
    waiting = b.invoke(double, (1,))  # a local call on b: one item, never a full batch
    while _waiting(b, double) != 1:
        await asyncio.sleep(0.005)
    await b.shutdown(graceful=False)
    with pytest.raises(AgentStateError, match=r"worker 'b' shut down before running .*double"):
        await waiting


async def test_without_an_agent_a_batch_runs_on_the_callers_loop() -> None:
    assert await asyncio.gather(*(double(i) for i in range(4))) == [0, 2, 4, 6]
    assert await asyncio.gather(square(3), square(4)) == [9, 16]
    assert double.stats()["sizes"] == {4: 1}


@batch(max_size=4, max_wait=LONG)
def resized(items: list[int]) -> list[int]:
    _record(items)
    return items


@pytest.fixture
def restore_resized() -> Any:
    yield
    resized.configure(max_size=4, max_wait=LONG)


async def test_a_smaller_max_size_starts_the_waiting_batch_at_once(
    pair: tuple[RpcAgent, RpcAgent], restore_resized: None
) -> None:
    a, b = pair
    calls = [a.rpc_async("b", resized, (i,)) for i in range(3)]  # 3 of 4: it waits
    while _waiting(b, resized) < 3:
        await asyncio.sleep(0.005)
    resized.configure(max_size=3)  # only 3 callers are left, say
    assert await asyncio.gather(*calls) == [0, 1, 2]
    assert Seen.batches == [[0, 1, 2]]


async def test_limits_configured_from_another_thread_apply_to_new_batches(
    pair: tuple[RpcAgent, RpcAgent], restore_resized: None
) -> None:
    a, _ = pair
    await asyncio.to_thread(resized.configure, max_size=2)
    assert await asyncio.gather(*(a.rpc_async("b", resized, (i,)) for i in range(4))) == [
        0,
        1,
        2,
        3,
    ]
    assert Seen.batches == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="max_size and max_queue must be >= 1"):
        resized.configure(max_size=0)
    assert resized.max_size == 2  # a refused change changes nothing


def test_a_batched_function_pickles_by_name() -> None:
    assert pickle.loads(pickle.dumps(double)) is double
    assert double.__name__ == "double" and double.rpc_name.endswith("test_batch_in_process.double")


def test_bad_limits_are_refused_when_decorating() -> None:
    with pytest.raises(ValueError, match="max_concurrent must be >= 1"):
        batch(max_concurrent=0)(lambda items: items)
    with pytest.raises(ValueError, match="max_size and max_queue must be >= 1"):
        batch(max_size=0)(lambda items: items)
