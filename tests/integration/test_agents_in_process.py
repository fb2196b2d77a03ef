"""Several agents on one event loop, over real loopback sockets: fast edge-case tests."""

from __future__ import annotations

import asyncio
import gc
import operator
import os
import pickle
import queue
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from asyncrpc import PeerLostError, RemoteError, RPCTimeoutError
from asyncrpc.agent import (
    DEFAULT_BUSY_POLL,
    AgentOptions,
    Lifecycle,
    RpcAgent,
    async_execution,
    current_agent,
    inbound,
)
from asyncrpc.agent.transfer import BY_NAME, PLAIN, TENSORS
from asyncrpc.errors import LocalProtocolError, SerializationError
from asyncrpc.serde import cuda
from asyncrpc.transport import NETWORK, Link
from asyncrpc.wire import Kind
from tests.in_process import SECRET, joined_agents

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["unix", "tcp"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RpcAgent, RpcAgent]]:
    options = AgentOptions(
        transports=(request.param,), handshake_timeout=0.5, max_running_per_link=8, rpc_timeout=10
    )
    async with joined_agents("ab", options) as agents:
        yield agents[0], agents[1]


class Probe:
    """What the remote functions below observe (fresh for every test and loop)."""

    started: asyncio.Event
    cancelled: asyncio.Event
    gate: asyncio.Event
    running_now = 0
    most_running = 0


@pytest.fixture(autouse=True)
async def probe() -> None:
    Probe.started, Probe.cancelled, Probe.gate = asyncio.Event(), asyncio.Event(), asyncio.Event()
    Probe.running_now = Probe.most_running = 0


async def wait_forever() -> None:
    Probe.started.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        Probe.cancelled.set()
        raise


async def wait_at_gate(i: int) -> int:
    Probe.running_now += 1
    Probe.most_running = max(Probe.most_running, Probe.running_now)
    await Probe.gate.wait()
    Probe.running_now -= 1
    return i


def each_plus_one(tensors: list[Any]) -> list[Any]:
    return [t + 1 for t in tensors]


async def test_a_call_of_twenty_thousand_tensors_and_its_reply_arrive_whole(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    """Far more tensors than a frame's header has descriptors for (a model's state, a
    batch of observations): every one arrives, both ways, as torch's RPC delivers them."""
    a, _ = pair
    sent = [torch.full((2,), float(i)) for i in range(20_000)] + [np.arange(3.0)]
    got = await a.rpc_async("b", each_plus_one, (sent,))
    assert len(got) == len(sent)
    assert [t.tolist() for t in got[:-1]] == [[i + 1.0] * 2 for i in range(20_000)]
    assert isinstance(got[-1], np.ndarray) and got[-1].tolist() == [1.0, 2.0, 3.0]


def twenty_thousand_tensors(_: Any) -> list[torch.Tensor]:
    return [torch.full((2,), 1.0) for _ in range(20_000)]


async def test_a_message_whose_header_cannot_fit_fails_its_call_by_name(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were every buffer out of band (no bound), 20,000 of them would need more header
    than a frame has: the call fails naming itself and the worker, both ways, and the
    link carries on."""
    monkeypatch.setattr("asyncrpc.serde.pickler.OUT_OF_BAND_MAX", 10**9)
    monkeypatch.setattr("asyncrpc.serde.lean.ENTRIES_MAX", 10**9)
    monkeypatch.setattr("asyncrpc.serde.lean._fit", lambda entries, widest: True)
    a, _ = pair
    many = [torch.full((2,), 1.0) for _ in range(20_000)]
    with pytest.raises(LocalProtocolError) as request:
        await a.rpc_async("b", each_plus_one, (many,))
    assert str(request.value).startswith(
        "call to tests.integration.test_agents_in_process.each_plus_one on worker 'b' "
        "cannot be sent: its frame header would take"
    )
    assert "(20000 buffers), more than the 65536 a header holds" in str(request.value)
    assert request.value.worker == "b"
    with pytest.raises(LocalProtocolError, match=r"reply of .*twenty_thousand_tensors from "):
        await a.rpc_async("b", twenty_thousand_tensors, (None,))  # (b's error, raised here)
    assert await a.rpc_async("b", operator.add, (1, 2)) == 3


async def test_tensors_of_many_dimensions_leave_the_lean_path_before_the_header_is_full(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    """500 tensors of 60 dimensions: ~130 bytes of header each on the lean path, 69 KB
    in all, more than a frame's header holds.  Their call takes ``dumps`` (their
    metadata in its payload) and succeeds, both ways."""
    a, _ = pair
    wide = [torch.full((1,) * 60, float(i)) for i in range(500)]
    got = await a.rpc_async("b", each_plus_one, (wide,))
    assert len(got) == 500
    assert all(t.shape == (1,) * 60 and t.item() == i + 1 for i, t in enumerate(got))


async def test_cancelling_a_calls_future_cancels_the_call(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    """As asyncio code cancels what it awaits (``wait_for``, ``asyncio.timeout``, a
    task cancelled): the callee's coroutine is cancelled, and nothing stays pending."""
    a, b = pair
    call = a.rpc_async("b", wait_forever)
    await asyncio.wait_for(Probe.started.wait(), 5)
    assert call.cancel()
    await asyncio.wait_for(Probe.cancelled.wait(), 5)  # the CANCEL reached the callee
    assert a.debug_info()["pending_outgoing_calls"] == 0
    made = a.metrics.snapshot()["made"][f"{__name__}.wait_forever"]["outcomes"]
    assert made == {"cancelled": 1}
    Probe.started.clear()
    Probe.cancelled.clear()
    with pytest.raises(TimeoutError):  # asyncio.wait_for cancels the call's future
        await asyncio.wait_for(a.rpc_async("b", wait_forever), 0.2)
    await asyncio.wait_for(Probe.cancelled.wait(), 5)
    assert a.debug_info()["pending_outgoing_calls"] == 0
    assert await a.rpc_async("b", small_result, args=(1,)) == (1, "ok")
    served = b.metrics.snapshot()["served"][f"{__name__}.wait_forever"]["outcomes"]
    assert served == {"cancelled": 2}


async def test_timeout_cancels_the_remote_coroutine(pair: tuple[RpcAgent, RpcAgent]) -> None:
    a, _ = pair
    with pytest.raises(RPCTimeoutError, match="'b'"):
        await a.rpc_async("b", wait_forever, timeout=0.2)
    assert Probe.started.is_set()
    await asyncio.wait_for(Probe.cancelled.wait(), 5)  # the CANCEL reached the callee


async def test_backlog_pauses_reading_and_every_call_completes(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    calls = [a.rpc_async("b", wait_at_gate, args=(i,)) for i in range(100)]
    while b.debug_info()["running_incoming_calls"] < 8:
        await asyncio.sleep(0)
    for _ in range(20):  # give the loop chances to (wrongly) admit more than the limit
        await asyncio.sleep(0)
    assert b.debug_info()["running_incoming_calls"] == 8
    Probe.gate.set()
    assert await asyncio.gather(*calls) == list(range(100))
    assert Probe.most_running <= 8 + 1  # reading pauses once the limit is reached


async def test_silent_connection_is_dropped_after_handshake_timeout(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    _, b = pair
    reader, writer = await _open(b)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on us
    writer.close()
    assert await b.rpc_async("a", torch.add, args=(1, 2)) == 3


async def test_truncated_frame_then_close_leaves_the_worker_serving(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    _reader, writer = await _open(b)
    writer.write(struct.pack("<HHI", 0xA5C1, 0, 200) + b"\x94\x01")  # promises 200 bytes
    await writer.drain()
    writer.close()
    assert await a.rpc_async("b", torch.add, args=(2, 2)) == 4


async def test_pending_calls_fail_when_the_peer_goes_away(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    assert await a.rpc_async("b", torch.add, args=(1, 1)) == 2
    call = a.rpc_async("b", wait_forever, timeout=0)  # no deadline: only the loss ends it
    await asyncio.wait_for(Probe.started.wait(), 5)
    await b.shutdown(graceful=False)
    with pytest.raises(PeerLostError, match="'b'"):
        await asyncio.wait_for(call, 5)
    assert a.debug_info()["pending_outgoing_calls"] == 0


def plain_noop() -> None:
    pass


async def coroutine_noop() -> None:
    pass


@pytest.mark.parametrize("function", [plain_noop, coroutine_noop], ids=["plain", "coroutine"])
async def test_requests_still_queued_when_the_callee_shuts_down_fail_cleanly(
    function: Callable[[], Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A link hands up a few frames a loop turn: requests still queued on it when the
    callee shuts down are dropped (its caller's calls fail with the link), not run
    against a link the callee forgot, which raised KeyError and logged an internal
    error."""
    async with joined_agents("ab", AgentOptions(rpc_timeout=10)) as (a, b):
        # Far more than the callee gets through in the turns the first reply takes
        # (600 were not, once calls got quicker: all done before the shutdown).
        calls = [a.rpc_async("b", function) for _ in range(5000)]
        await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
        await b.shutdown(graceful=False)
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
    assert {type(o) for o in outcomes} <= {type(None), PeerLostError}
    assert any(o is None for o in outcomes) and any(o is not None for o in outcomes)
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]


async def test_large_tensors_use_shared_memory_and_release_it(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    x = torch.randn(4 * 1024 * 1024)  # 16 MiB, above the shared-memory threshold
    y = await a.rpc_async("b", torch.mul, args=(x, 2))
    assert torch.equal(y, x * 2)
    stats = b.debug_info()["shared_memory"]
    assert stats["segments_in_use"] == 1  # our y still maps b's reply segment
    del y
    while b.debug_info()["shared_memory"]["segments_in_use"]:
        await asyncio.sleep(0.01)  # waiting for the RELEASE message to arrive
    assert b.debug_info()["shared_memory"]["segments_idle"] >= 1


async def _open(agent: RpcAgent) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    address = next(iter(agent.address.addresses.values()))
    if address.startswith("tcp://"):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        return await asyncio.open_connection(host, int(port))
    sock = socket.socket(socket.AF_UNIX)
    sock.connect("\0" + address.removeprefix("unix://@"))
    return await asyncio.open_unix_connection(sock=sock)


class Shared:
    """One future that every caller of ``join_batch`` waits on (the batching pattern)."""

    future: asyncio.Future[str] | None = None


@async_execution
def join_batch() -> asyncio.Future[str]:
    if Shared.future is None:
        Shared.future = asyncio.get_running_loop().create_future()
    return Shared.future


async def cancel_myself() -> None:
    raise asyncio.CancelledError


async def test_one_callers_timeout_does_not_cancel_a_shared_batch(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    Shared.future = None
    impatient = a.rpc_async("b", join_batch, timeout=0.1)
    patient = a.rpc_async("b", join_batch, timeout=10)
    with pytest.raises(RPCTimeoutError):
        await impatient
    while b.debug_info()["running_incoming_calls"] != 1:
        await asyncio.sleep(0.01)  # until the impatient call's CANCEL has been handled
    assert Shared.future is not None and not Shared.future.cancelled()
    Shared.future.set_result("batch done")
    assert await patient == "batch done"


async def test_a_call_given_up_leaves_no_unseen_error_behind(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    """The caller gave up (a timeout); the future its call waited on fails later. The
    call is gone, so its error must not surface as asyncio's "exception was never
    retrieved" (before: logged once the future was collected)."""
    a, b = pair
    Shared.future = None
    with pytest.raises(RPCTimeoutError):
        await a.rpc_async("b", join_batch, timeout=0.1)
    while b.debug_info()["running_incoming_calls"]:
        await asyncio.sleep(0.01)  # until its CANCEL has been handled
    unseen: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unseen.append(context))
    try:
        assert Shared.future is not None
        Shared.future.set_exception(ValueError("the batch failed"))
        await asyncio.sleep(0)  # its callbacks run
        Shared.future = None
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert unseen == []


async def test_cancellation_inside_the_callee_is_reported(pair: tuple[RpcAgent, RpcAgent]) -> None:
    a, _ = pair
    with pytest.raises(RemoteError, match="cancelled on worker 'b'"):
        await a.rpc_async("b", cancel_myself)


async def test_oversized_call_raises_at_once_and_leaves_nothing_pending() -> None:
    options = AgentOptions(transports=("unix",), max_frame_size=1024)
    agent = RpcAgent("solo", 0, SECRET, options)
    agent.join([await agent.start()])
    with pytest.raises(LocalProtocolError, match="max_frame_size"):
        agent.rpc_async("solo", torch.add, args=(torch.zeros(1000), 1))
    assert agent.debug_info()["pending_outgoing_calls"] == 0
    await agent.shutdown()


async def test_shutdown_with_no_time_limit_waits_for_the_peer(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    first = asyncio.ensure_future(a.shutdown(timeout=0))  # 0: no limit, as in torch
    for _ in range(10):
        await asyncio.sleep(0)
    assert not first.done()  # it waits for b, however long
    await asyncio.gather(first, b.shutdown(timeout=0))
    assert a.state == b.state == "closed"


class _CopyInFlight:
    """A CUDA copy's event, as the releaser thread waits for it: until ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        self.done.wait()


async def test_a_graceful_shutdown_waits_until_the_cuda_memory_peers_shared_is_let_go(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Else a peer may abort as it exits (docs/cuda.md).  serde.cuda's releaser runs its
    real loop over a queue of this test; fakes stand for a copy and a peer's storage."""
    jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
    kept = cuda.KeptMappings(keep_for=60.0)
    monkeypatch.setattr(cuda, "_release_queue", jobs)
    threading.Thread(target=cuda._release_forever, args=(jobs, kept), daemon=True).start()
    copy, held = _CopyInFlight(), ["a peer's storage"]
    jobs.put((copy, held, None, ("peer gpu", b"segment"), 10))  # queued before shutdown
    asked = asyncio.Event()
    let_go_of_peers = cuda.let_go_of_peers

    def spy() -> Future[None] | None:
        asked.set()
        return let_go_of_peers()

    monkeypatch.setattr(cuda, "let_go_of_peers", spy)
    shutdowns = [asyncio.ensure_future(agent.shutdown()) for agent in pair]
    await asked.wait()  # one worker is between its barriers...
    assert not any(s.done() for s in shutdowns)  # ...and waits for the releaser
    copy.done.set()
    await asyncio.gather(*shutdowns)
    assert held == [] and len(kept) == 0  # (its storage was kept, then let go)


async def test_a_shutdown_without_the_barriers_lets_go_of_cuda_memory_too(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[Future[None]] = []

    def never_done() -> Future[None]:
        asked.append(Future())
        return asked[-1]

    monkeypatch.setattr(cuda, "let_go_of_peers", never_done)
    await pair[0].shutdown(graceful=False)  # returns: the release is not waited for
    assert len(asked) == 1


async def test_a_worker_shut_down_lists_no_connected_peer(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    assert await a.rpc_async("b", operator.add, (1, 2)) == 3  # a link both ways
    assert await b.rpc_async("a", operator.add, (1, 2)) == 3
    assert a.debug_info()["connected_peers"] == ["b"]
    seen_on_return: list[list[str]] = []  # the moment each shutdown returns, no turn later

    async def shut(agent: RpcAgent) -> None:
        await agent.shutdown()
        seen_on_return.append(agent.debug_info()["connected_peers"])

    await asyncio.gather(shut(a), shut(b))
    assert seen_on_return == [[], []]


async def test_a_peer_given_up_for_dead_at_shutdown_is_answered_when_it_shows_up(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """a cannot dial b when it first announces its shutdown (b's loop was blocked past
    the handshake timeout, say) and gives b up for dead; b is alive and announces its
    own.  a must answer with the notices b missed, or b would wait for them forever."""
    a, b = pair
    dial = a._connect

    async def refuse_once(name: str) -> Any:
        monkeypatch.setattr(a, "_connect", dial)
        raise PeerLostError(f"handshake with {name!r} timed out (simulated)")

    monkeypatch.setattr(a, "_connect", refuse_once)
    first = asyncio.ensure_future(a.shutdown())
    await asyncio.wait_for(asyncio.gather(first, b.shutdown()), 20)
    assert a.state == b.state == "closed"


async def test_a_shutdown_that_runs_out_of_time_names_the_workers_it_waited_for() -> None:
    options = AgentOptions(transports=("unix",), rpc_timeout=10)
    async with joined_agents("abc", options) as (a, b, c):
        b_done = asyncio.ensure_future(b.shutdown())
        with pytest.raises(RPCTimeoutError, match=r"have not called shutdown: \['c'\]"):
            await a.shutdown(timeout=0.5)  # b is shutting down too, c is not
        assert a.state == Lifecycle.CLOSED
        await asyncio.wait_for(asyncio.gather(b_done, c.shutdown()), 20)  # a: closed, gone


async def test_a_peer_that_reconnects_after_our_announcement_is_told_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """a announces phase 1 to b and c, and waits for c.  The only link between a and b
    drops, so each counts the other lost.  When b dials a again, a tells it once more,
    on the new link: what it sent on the old one may never have arrived."""
    options = AgentOptions(transports=("unix",), rpc_timeout=10)
    async with joined_agents("abc", options) as (a, b, c):
        heard: list[tuple[Link, Any]] = []  # the SHUTDOWN frames b receives
        on_shutdown_notice = b._on_shutdown_notice

        def spy(link: Link, phase: Any) -> None:
            heard.append((link, phase))
            on_shutdown_notice(link, phase)

        monkeypatch.setattr(b, "_on_shutdown_notice", spy)
        first = asyncio.ensure_future(a.shutdown())
        await until(lambda: len(heard) == 1)
        old = heard[0][0]
        old.abort(PeerLostError("dropped on purpose"))
        await until(lambda: a.debug_info()["dead_peers"] == ["b"])
        assert await b.rpc_async("a", operator.add, args=(1, 2)) == 3  # b dials a again
        assert [phase for _, phase in heard] == [1, 1]
        assert heard[1][0] is not old
        await asyncio.wait_for(asyncio.gather(first, b.shutdown(), c.shutdown()), 20)
        assert a.state == b.state == c.state == Lifecycle.CLOSED


async def until(condition: Callable[[], bool], limit: float = 5.0) -> None:
    """Wait (bounded) for a condition that the agents' loop, ours, makes true."""
    async with asyncio.timeout(limit):
        while not condition():
            await asyncio.sleep(0)


def fails_on_purpose(why: str) -> None:
    raise ValueError(why)


def small_result(n: int) -> tuple[int, str]:
    return n, "ok"


def tensor_result(n: int) -> torch.Tensor:
    return torch.full((4,), float(n))


def lambda_result() -> Any:
    return lambda: None  # plain by type, yet pickle cannot find it by name


async def test_a_pool_functions_plain_result_is_pickled_on_the_loop_and_a_tensor_in_the_pool(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python in a pool thread costs several times what it costs on the loop, so a
    plain result (a few scalars) goes back to the loop as it is; a tensor, whose copy
    into shared memory may be large, is still serialised in its pool thread."""
    a, b = pair
    pickled_on: dict[str, int] = {}
    inbound = b._inbound
    dumps_reply, plain_reply = inbound._dumps_reply, inbound._plain_reply

    def recording(peer_rank: int, result: Any, *, call_id: int, function: str) -> Any:
        pickled_on[function.rsplit(".", 1)[-1]] = threading.get_ident()
        return dumps_reply(peer_rank, result, call_id=call_id, function=function)

    def recording_plain(call: Any, result: Any) -> bytes | None:
        pickled_on[call.function.rsplit(".", 1)[-1]] = threading.get_ident()
        return plain_reply(call, result)

    inbound._dumps_reply = recording
    monkeypatch.setattr(inbound, "_plain_reply", recording_plain)
    assert await a.rpc_async("b", small_result, args=(3,)) == (3, "ok")
    assert torch.equal(await a.rpc_async("b", tensor_result, args=(2,)), torch.full((4,), 2.0))
    assert pickled_on["small_result"] == threading.get_ident()  # the loop's thread
    assert pickled_on["tensor_result"] != threading.get_ident()  # a pool thread


async def test_plain_requests_and_replies_are_marked_plain_and_others_are_not(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a message no reducer had a part in says PLAIN in its header (its receiver
    then unpickles it without a Transfer): one of plain values, and one whose tensors
    are plain too (their entries in TENSORS); a tensor that requires grad, or a
    Parameter, is a reducer's, and its message says neither."""
    a, b = pair
    marked: list[tuple[str, bool, int | None]] = []
    on_request, on_reply = b._inbound.on_request, a._on_reply

    def mark(what: str, frame: Any) -> None:
        tensors = frame.meta.get(TENSORS)
        marked.append((what, PLAIN in frame.meta, None if tensors is None else len(tensors)))

    def recording_request(link: Link, frame: Any) -> None:
        mark("request", frame)
        on_request(link, frame)

    def recording_reply(link: Link, frame: Any) -> None:
        mark("reply", frame)
        on_reply(link, frame)

    monkeypatch.setattr(b._inbound, "on_request", recording_request)
    monkeypatch.setattr(a, "_on_reply", recording_reply)
    assert await a.rpc_async("b", small_result, args=(3,)) == (3, "ok")
    assert marked == [("request", True, None), ("reply", True, None)]
    marked.clear()
    assert torch.equal(await a.rpc_async("b", tensor_result, args=(2,)), torch.full((4,), 2.0))
    assert marked == [("request", True, None), ("reply", True, 1)]
    marked.clear()
    assert await a.rpc_async("b", torch.numel, args=(torch.ones(3),)) == 3
    assert marked == [("request", True, 1), ("reply", True, None)]
    marked.clear()
    needs_grad = torch.ones(3, requires_grad=True)
    assert await a.rpc_async("b", operator.attrgetter("requires_grad"), args=(needs_grad,))
    parameter = torch.nn.Parameter(torch.ones(2))
    assert await a.rpc_async("b", type, args=(parameter,)) is torch.nn.Parameter
    assert marked == [("request", False, None), ("reply", True, None)] * 2


async def test_a_function_found_by_name_travels_beside_its_arguments_and_others_inside(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module-level function goes as ``module:qualname`` in the header, its payload
    only the arguments; any other callable (a builtin, a bound method) still pickles
    with them.  Both kinds run, plain or not, and a name the callee cannot find fails
    that call alone."""
    a, b = pair
    seen: list[tuple[Any, Any]] = []
    on_request = b._inbound.on_request

    def recording(link: Link, frame: Any) -> None:
        seen.append((frame.meta.get(BY_NAME), bytes(frame.payload)))
        on_request(link, frame)

    monkeypatch.setattr(b._inbound, "on_request", recording)
    assert await a.rpc_async("b", small_result, args=(3,)) == (3, "ok")
    name, payload = seen.pop()
    assert name == f"{__name__}:small_result" and pickle.loads(payload) == ((3,), {})
    assert await a.rpc_async("b", torch.numel, args=(torch.ones(3),)) == 3  # not plain
    name, payload = seen.pop()
    assert name is None and b"numel" in payload
    assert torch.equal(await a.rpc_async("b", tensor_result, args=(2,)), torch.full((4,), 2.0))
    assert seen.pop()[0] == f"{__name__}:tensor_result"

    call_id = next(a._ids)
    call = a._pend(call_id, "b", "missing", 5.0)
    meta = {"i": call_id, "f": "missing", BY_NAME: f"{__name__}:not_defined_here"}
    a._links["b"].send(Kind.REQUEST, meta, pickle.dumps(((), {})))
    with pytest.raises(SerializationError, match="not_defined_here") as caught:
        await call
    assert "does not serialize function code" in str(caught.value)
    assert await a.rpc_async("b", operator.add, args=(2, 2)) == 4


async def test_a_plain_request_its_link_refuses_fails_its_call_and_leaves_nothing_pending(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    """A plain request is recorded as pending only after its write: if the link refuses
    it (lost, its loss not yet handled), its call still fails with the link's error,
    is counted, and is no longer pending."""
    a, _ = pair
    assert await a.rpc_async("b", small_result, args=(1,)) == (1, "ok")
    link = a._links["b"]
    link.closed = True  # as between the connection's loss and link_lost
    try:
        with pytest.raises(PeerLostError, match="lost before the message was written"):
            await a.rpc_async("b", small_result, args=(2,))
    finally:
        link.closed = False
    assert a.debug_info()["pending_outgoing_calls"] == 0
    made = a.metrics.snapshot()["made"][f"{__name__}.small_result"]["outcomes"]
    assert made == {"ok": 1, "lost": 1}
    assert await a.rpc_async("b", small_result, args=(3,)) == (3, "ok")


async def test_an_unpicklable_plain_result_fails_its_call_naming_it_and_the_worker_serves_on(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    with pytest.raises(SerializationError, match="lambda_result") as caught:
        await a.rpc_async("b", lambda_result)
    assert "'b'" in str(caught.value)
    assert await a.rpc_async("b", small_result, args=(1,)) == (1, "ok")


async def test_an_unpicklable_argument_fails_its_call_naming_it_the_worker_and_the_cause(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    for args in ((lambda: 1,), (torch.ones(2), threading.Lock())):  # plain, and with a tensor
        with pytest.raises(SerializationError) as caught:
            a.rpc_async("b", small_result, args=args)
        message = str(caught.value)
        assert message.startswith(f"call to {__name__}.small_result on worker 'b' cannot be sent: ")
        assert "pickle" in message, message
        assert caught.value.worker == "b" and caught.value.function == f"{__name__}.small_result"
    assert a.debug_info()["pending_outgoing_calls"] == 0
    assert await a.rpc_async("b", small_result, args=(1,)) == (1, "ok")


async def test_a_failed_call_is_logged_on_the_callee(
    pair: tuple[RpcAgent, RpcAgent], caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = pair
    caplog.set_level("INFO", logger="asyncrpc.agent.calls")
    with pytest.raises(ValueError, match="on purpose"):
        await a.rpc_async("b", fails_on_purpose, ("on purpose",))
    (record,) = [r for r in caplog.records if r.name == "asyncrpc.agent.calls"]
    assert record.levelname == "INFO"
    message = record.getMessage()
    assert "'b'" in message and "fails_on_purpose" in message and "'a'" in message
    assert "ValueError('on purpose')" in message
    assert record.exc_info is not None and record.exc_info[0] is ValueError  # the traceback


async def test_an_internal_error_fails_the_link_with_its_cause_and_is_logged(
    pair: tuple[RpcAgent, RpcAgent],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = pair
    assert await a.rpc_async("b", torch.add, args=(1, 1)) == 2  # connected

    def broken(link: object, frame: object) -> None:
        raise RuntimeError("simulated bug in request handling")

    monkeypatch.setattr(b._inbound, "on_request", broken)
    with pytest.raises(PeerLostError, match="'b'"):
        await asyncio.wait_for(a.rpc_async("b", torch.add, args=(1, 1)), 5)
    assert "internal error handling a frame" in caplog.text
    assert "simulated bug" in caplog.text
    monkeypatch.undo()
    assert await a.rpc_async("b", torch.add, args=(2, 2)) == 4  # a new link serves again


def thread_and_result(value: int, seconds: float = 0.0) -> tuple[int, int]:
    time.sleep(seconds)  # a job that takes this long (not a synchronisation)
    return threading.get_ident(), value


async def test_offload_learns_to_run_quick_kinds_on_the_loop(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair
    loop_thread = threading.get_ident()
    # Any job is quick under a limit of a minute (a loaded machine may preempt even a
    # trivial one for a millisecond); the real limit is checked with a slow job below.
    monkeypatch.setattr(inbound, "INLINE_BELOW", 60.0)
    first, one = await a.offload("quick", thread_and_result, 1)
    assert (one, first != loop_thread) == (1, True)  # a new kind goes to the pool
    again = a.offload("quick", thread_and_result, 2)
    assert again.done() and again.result() == (loop_thread, 2)  # it proved quick
    with pytest.raises(ZeroDivisionError):
        await a.offload("quick", divmod, 1, 0)  # errors come back through the future
    monkeypatch.undo()
    slow = 2 * inbound.INLINE_BELOW
    assert (await a.offload("slow", thread_and_result, 3, slow))[0] != loop_thread
    assert (await a.offload("slow", thread_and_result, 4))[0] != loop_thread  # still slow


async def test_busy_polling_only_while_this_hosts_workers_have_a_cpu_each(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    cpus = len(os.sched_getaffinity(0))
    assert a._busy_poll_window([a.address, b.address]) == (DEFAULT_BUSY_POLL if cpus >= 2 else 0)
    crowd = [replace(a.address, name=f"w{i}", rank=i) for i in range(cpus + 1)]
    assert a._busy_poll_window(crowd) == 0  # one more process than CPUs: no spinning
    a.options = replace(a.options, busy_poll=1e-3)
    assert a._busy_poll_window(crowd) == 1e-3  # as configured


async def test_joining_warns_when_the_workers_torch_threads_crowd_this_hosts_cpus(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cpus)  # torch's default
    with caplog.at_level("WARNING", logger="asyncrpc.agent"):
        async with joined_agents("ab", AgentOptions(transports=("unix",))):
            pass
    crowded = [r.getMessage() for r in caplog.records if "OMP_NUM_THREADS" in r.getMessage()]
    assert len(crowded) == 2 and "worker 'a'" in crowded[0] and "worker 'b'" in crowded[1]
    each = max(1, cpus // 2)
    assert f"torch.set_num_threads({each})" in crowded[0]
    caplog.clear()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    with caplog.at_level("WARNING", logger="asyncrpc.agent"):
        async with joined_agents("ab", AgentOptions(transports=("unix",))):
            pass
    assert not [r for r in caplog.records if "OMP_NUM_THREADS" in r.getMessage()]


async def call_back_the_caller() -> str:
    """Runs on b: needs b to know every worker, as any call that calls onwards does."""
    agent = current_agent()
    assert agent is not None
    return str(await agent.rpc_async(0, function_name_of_agent))


def function_name_of_agent() -> str:
    agent = current_agent()
    assert agent is not None
    return agent.info.name


class Arrivals(list[Any]):
    """A list that says when something is appended to it."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def append(self, item: Any) -> None:
        super().append(item)
        self.changed.set()


async def test_a_call_that_arrives_before_join_waits_for_it() -> None:
    """A peer that finished the rendezvous first may call a worker that has not joined
    yet; the call must run once it has, not fail because it knows no workers."""
    options = AgentOptions(transports=("unix",), rpc_timeout=10)
    a, b = (RpcAgent(name, rank, SECRET, options) for rank, name in enumerate("ab"))
    addresses = [await a.start(), await b.start()]
    a.join(addresses)
    arrived = Arrivals()
    b._early_frames = arrived
    try:
        call = a.rpc_async("b", call_back_the_caller)
        await asyncio.wait_for(arrived.changed.wait(), 10)
        assert not call.done()
        b.join(addresses)
        assert await asyncio.wait_for(call, 10) == "a"
    finally:
        await asyncio.gather(a.shutdown(graceful=False), b.shutdown(graceful=False))


# -- KeyboardInterrupt and SystemExit in remote code end the call, not the callee -------


def interrupt_in_thread(kind: str) -> None:
    raise {"interrupt": KeyboardInterrupt, "exit": SystemExit}[kind]("from remote code")


async def interrupt_on_loop(kind: str) -> None:
    raise {"interrupt": KeyboardInterrupt, "exit": SystemExit}[kind]("from remote code")


@pytest.mark.parametrize("kind", ["interrupt", "exit"])
@pytest.mark.parametrize("where", [interrupt_in_thread, interrupt_on_loop], ids=["thread", "loop"])
async def test_keyboard_interrupt_and_system_exit_fail_only_the_call(
    pair: tuple[RpcAgent, RpcAgent], kind: str, where: Any
) -> None:
    a, b = pair
    with pytest.raises(Exception) as caught:  # `except Exception` catches it
        await a.rpc_async("b", where, args=(kind,))
    assert isinstance(caught.value, RemoteError)
    original = "KeyboardInterrupt" if kind == "interrupt" else "SystemExit"
    assert original in str(caught.value) and "from remote code" in str(caught.value)
    assert caught.value.remote_worker == "b"  # type: ignore[attr-defined]
    assert b.state == "running"
    assert await a.rpc_async("b", operator.add, args=(1, 2)) == 3  # the callee still serves


# -- torch's meanings ---------------------------------------------------------------------


@async_execution
def chained_torch_future(x: int) -> Any:
    """What torch tutorials do: reply with the future that ``then()`` returns."""
    first: torch.futures.Future[int] = torch.futures.Future()
    chained = first.then(lambda done: done.value() + 1)
    first.set_result(x)
    return chained


async def test_async_execution_accepts_the_future_then_returns(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    assert await a.rpc_async("b", chained_torch_future, args=(41,)) == 42


def test_negative_timeout_means_the_default_as_in_torch() -> None:
    options = AgentOptions(rpc_timeout=7.0)
    assert options.timeout_for(None) == options.timeout_for(-1) == options.timeout_for(-1.0) == 7
    assert options.timeout_for(0) == 0  # no deadline
    assert options.timeout_for(2.5) == 2.5


async def test_a_call_with_timeout_minus_one_has_the_default_deadline() -> None:
    options = AgentOptions(transports=("unix",), rpc_timeout=0.3)
    async with joined_agents("ab", options) as (a, _):
        with pytest.raises(RPCTimeoutError, match=r"after 0\.3s"):
            await a.rpc_async("b", wait_forever, timeout=-1)


ARRIVALS: list[int] = []


async def arrive(i: int) -> None:
    ARRIVALS.append(i)


async def test_a_call_made_as_the_link_comes_up_does_not_overtake_queued_ones(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    ARRIVALS.clear()
    first = a.rpc_async(b.info.name, arrive, (1,))  # no link yet: queued behind the dial
    async with asyncio.timeout(10):
        while b.info.name not in a._links:  # the link is up; `first` may not be sent yet
            await asyncio.sleep(0)
    second = a.rpc_async(b.info.name, arrive, (2,))
    await asyncio.gather(first, second)
    assert ARRIVALS == [1, 2]


def test_an_unknown_transport_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"\['ipc'\].*each must be one of \['tcp', 'unix'\]"):
        AgentOptions(transports=("ipc",))


async def test_a_scheme_registered_in_schemes_serves_agents_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent asks a transport only what its Scheme says: a new entry in SCHEMES (here
    tcp under another name, host-local) is listened on, published and dialed."""
    from asyncrpc.transport import endpoints

    tcp = endpoints.SCHEMES["tcp"]

    async def listen(factory: endpoints.Factory, rest: str) -> tuple[asyncio.AbstractServer, str]:
        server, bound = await tcp.listen(factory, rest)
        return server, bound.replace("tcp://", "loop://", 1)

    loop_scheme = endpoints.Scheme(
        listen, tcp.dial, lambda host, _, port: f"loop://{host}:{port}", scope=NETWORK
    )
    monkeypatch.setitem(endpoints.SCHEMES, "loop", loop_scheme)
    async with joined_agents("ab", AgentOptions(transports=("loop",), rpc_timeout=10)) as (a, b):
        assert a.address is not None and list(a.address.addresses) == ["loop"]
        assert a.address.addresses["loop"].startswith("loop://127.0.0.1:")
        assert await b.rpc_async("a", operator.add, (2, 3)) == 5


async def test_debug_info_says_which_transport_each_link_uses_and_why() -> None:
    async with joined_agents("ab", AgentOptions(rpc_timeout=10)) as (_, b):
        assert b.debug_info()["links"] == {}
        assert await b.rpc_async("a", operator.add, (2, 3)) == 5
        assert b.debug_info()["links"] == {
            "a": {
                "transport": "unix",
                "why": "same network namespace",
                "shared_memory": True,
                "shared_memory_why": "same kernel, PID namespace and user",
                "stripes": 0,
                "stripes_why": "not a tcp link",
            }
        }


async def test_a_unix_dial_nobody_answers_falls_back_to_tcp_at_once_and_for_good(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The hosts say unix, but nobody listens at the peer's unix address (as when it is
    in another network namespace that its host does not show): the call goes over tcp
    at once, and that peer is never dialed on unix again."""
    from asyncrpc.transport import endpoints

    unix = endpoints.SCHEMES["unix"]
    dialed: list[str] = []

    async def dial(factory: endpoints.Factory, rest: str) -> asyncio.BaseProtocol:
        dialed.append(rest)
        return await unix.dial(factory, rest)

    monkeypatch.setitem(endpoints.SCHEMES, "unix", replace(unix, dial=dial))
    nobody = f"@asyncrpc-nobody-{os.getpid()}-{id(dialed):x}"
    async with joined_agents("ab", AgentOptions(rpc_timeout=10)) as (_, b):
        target = b.resolve("a")
        b._workers["a"] = replace(
            target, addresses={**target.addresses, "unix": f"unix://{nobody}"}
        )
        assert await b.rpc_async("a", operator.add, (2, 3)) == 5
        link = b.debug_info()["links"]["a"]
        assert link["transport"] == "tcp"
        assert link["why"] == "unix dial failed: [Errno 111] Connection refused"
        (warning,) = [r for r in caplog.records if "cannot connect" in r.getMessage()]
        assert "dialing worker 'a' on tcp" in warning.getMessage()

        b._links["a"].close()  # the next call dials again: on tcp alone
        for _ in range(200):
            if "a" not in b._links:
                break
            await asyncio.sleep(0.01)
        assert await b.rpc_async("a", operator.add, (1, 1)) == 2
        assert b.debug_info()["links"]["a"]["transport"] == "tcp"
        assert dialed == [nobody]


async def test_a_fixed_listen_port_is_used_and_one_in_use_fails_naming_it() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options = AgentOptions(transports=("unix", "tcp"), listen_port=port)
    first = RpcAgent("a", 0, SECRET, options)
    address = await first.start()
    assert address.addresses["tcp"] == f"tcp://127.0.0.1:{port}"
    second = RpcAgent("b", 1, SECRET, options)
    try:
        with pytest.raises(OSError, match=f"worker 'b' cannot listen on tcp://127.0.0.1:{port}"):
            await second.start()
        assert all(not server.is_serving() for server in second._servers)  # unix closed too
    finally:
        await first.shutdown(graceful=False)
