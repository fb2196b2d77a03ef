"""What the workers of integration-test jobs do (see tests/cluster.py).

Remote functions live here too, at module level, so they travel by reference
(``tests.scenarios.NAME``) as user code would.  Each scenario returns plain
observations; the tests make the assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pickle
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import asyncrpc
from asyncrpc.functions import async_execution


@dataclass
class Config:
    rank: int
    world: int
    port: int
    transport: str

    @property
    def name(self) -> str:
        return f"w{self.rank}"

    async def join(self, **options: Any) -> None:
        transports = ("unix", "tcp") if self.transport == "unix" else ("tcp",)
        options.setdefault("transports", transports)
        await asyncrpc.init_rpc(
            self.name,
            rank=self.rank,
            world_size=self.world,
            init_method=f"tcp://127.0.0.1:{self.port}",
            **options,
        )


# -- remote functions -------------------------------------------------------------


def add(a: Any, b: Any) -> Any:
    return a + b


async def double(x: Any) -> Any:
    await asyncio.sleep(0)
    return 2 * x


def echo(x: Any) -> Any:
    return x


def whoami() -> str:
    return asyncrpc.get_worker_info().name


async def ask_back(to: str) -> str:
    """A nested call: the callee calls another worker before answering."""
    return f"{asyncrpc.get_worker_info().name}<-{await asyncrpc.rpc_async(to, whoami)}"


def sync_from_thread(to: str) -> Any:
    """Runs in the callee's thread pool and uses the blocking API from there."""
    return asyncrpc.rpc_sync(to, add, args=(20, 22))


def fail(message: str) -> None:
    raise ValueError(message)


class UnpicklableError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def fail_unpicklably() -> None:
    raise UnpicklableError("carries a lock")


def return_unpicklable() -> Any:
    return threading.Lock()


async def sleep_for(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


def block_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@async_execution
def torch_future_double(x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    threading.Thread(target=lambda: future.set_result(x * 2)).start()
    return future


@async_execution
def coroutine_triple(x: int) -> Any:
    return double(x * 1.5)


class Batcher:
    """The tutorial's batching pattern: N callers wait until the batch is full."""

    size = 4
    pending: list[int] = []  # noqa: RUF012
    future: asyncio.Future[int] | None = None

    @staticmethod
    @async_execution
    def push(value: int) -> asyncio.Future[int]:
        if Batcher.future is None:
            Batcher.future = asyncio.get_running_loop().create_future()
        future = Batcher.future
        Batcher.pending.append(value)
        if len(Batcher.pending) == Batcher.size:
            future.set_result(sum(Batcher.pending))
            Batcher.pending, Batcher.future = [], None
        return future


# -- helpers ------------------------------------------------------------------------


async def outcome(awaitable: Any) -> dict[str, Any]:
    """What a call produced: its value, or its error's type, message and ancestry."""
    try:
        return {"value": await awaitable}
    except BaseException as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "timeout": isinstance(exc, TimeoutError),
            "connection": isinstance(exc, ConnectionError),
            "asyncrpc": isinstance(exc, asyncrpc.AsyncRPCError),
            "remote_worker": getattr(exc, "remote_worker", None),
            "remote_traceback": getattr(exc, "remote_traceback", None),
        }


def raises(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


# -- scenarios ------------------------------------------------------------------------


async def basics(cfg: Config) -> dict[str, Any]:
    """Rank 0 exercises the API against rank 1; rank 1 serves."""
    await cfg.join(rpc_timeout=20)
    seen: dict[str, Any] = {"linked_at_init": sorted(asyncrpc.get_debug_info()["links"])}
    if cfg.rank == 0:
        seen.update(await _calls(cfg))
        seen.update(await _errors())
        seen.update(await _tensors())
        seen.update(await _async_execution())
        seen["debug"] = asyncrpc.get_debug_info()
    await asyncrpc.shutdown()
    return seen


async def _calls(cfg: Config) -> dict[str, Any]:
    y = await asyncrpc.rpc_async("w1", torch.add, args=(torch.ones(3), 1))
    many = await asyncio.gather(*(asyncrpc.rpc_async("w1", double, args=(i,)) for i in range(1000)))
    info = asyncrpc.get_worker_info("w1")
    return {
        "torch_add": y.tolist(),
        "coroutines": sum(many),
        "by_rank": await asyncrpc.rpc_async(1, whoami),
        "by_info": await asyncrpc.rpc_async(info, whoami),
        "to_self": await asyncrpc.rpc_async("w0", whoami),
        "kwargs": await asyncrpc.rpc_async("w1", add, kwargs={"a": 1, "b": 2}),
        "nested": await asyncrpc.rpc_async("w1", ask_back, args=("w0",)),
        "rpc_sync_in_thread": await asyncrpc.rpc_async("w1", sync_from_thread, args=("w0",)),
        "rpc_sync_on_loop": raises(asyncrpc.rpc_sync, "w1", whoami),
        "worker_info": [info.id, info.name],
    }


async def _errors() -> dict[str, Any]:
    return {
        "remote_value_error": await outcome(asyncrpc.rpc_async("w1", fail, args=("boom",))),
        "remote_unpicklable_error": await outcome(asyncrpc.rpc_async("w1", fail_unpicklably)),
        "unpicklable_result": await outcome(asyncrpc.rpc_async("w1", return_unpicklable)),
        "unpicklable_argument": raises(asyncrpc.rpc_async, "w1", echo, args=(threading.Lock(),)),
        "unknown_worker": raises(asyncrpc.rpc_async, "nobody", whoami),
        "unknown_function": await outcome(asyncrpc.rpc_async("w1", _only_here())),
        "timeout": await outcome(asyncrpc.rpc_async("w1", sleep_for, args=(30,), timeout=0.3)),
        "thread_timeout": await outcome(
            asyncrpc.rpc_async("w1", block_for, args=(2,), timeout=0.3)
        ),
        "alive_after_errors": await asyncrpc.rpc_async("w1", whoami),
    }


def _only_here() -> Any:
    """A function that exists on the caller only (registered at run time)."""

    def only_on_caller() -> None:
        return None

    only_on_caller.__qualname__ = "only_on_caller"
    globals()["only_on_caller"] = only_on_caller
    return only_on_caller


async def _tensors() -> dict[str, Any]:
    samples = {
        "float32": torch.randn(5, 7),
        "float64_transposed": torch.randn(4, 3, dtype=torch.float64).t(),
        "bfloat16": torch.randn(6).to(torch.bfloat16),
        "complex64": torch.randn(3, dtype=torch.complex64),
        "bool": torch.tensor([True, False, True]),
        "int64_scalar": torch.tensor(7),
        "empty": torch.empty(0, 4),
        "view_of_big": torch.arange(1_000_000.0)[10:20],
        "strided_slice": torch.arange(100.0).reshape(10, 10)[:, ::3],
        "large_8mb": torch.randn(2 * 1024 * 1024),
    }
    seen = {}
    for name, t in samples.items():
        back = await asyncrpc.rpc_async("w1", echo, args=(t,))
        seen[f"tensor_{name}"] = bool(torch.equal(back, t)) and back.dtype == t.dtype
    grad = await asyncrpc.rpc_async("w1", echo, args=(torch.ones(2, requires_grad=True),))
    seen["requires_grad_kept"] = grad.requires_grad
    nested = await asyncrpc.rpc_async("w1", echo, args=({"a": [torch.ones(2), (torch.zeros(1),)]},))
    seen["nested_containers"] = nested["a"][0].tolist() + nested["a"][1][0].tolist()
    return seen


async def _async_execution() -> dict[str, Any]:
    batch = await asyncio.gather(
        *(asyncrpc.rpc_async("w1", Batcher.push, args=(i,)) for i in range(8))
    )
    return {
        "batched": batch,
        "torch_future": (
            await asyncrpc.rpc_async("w1", torch_future_double, args=(torch.ones(2),))
        ).tolist(),
        "coroutine_awaitable": await asyncrpc.rpc_async("w1", coroutine_triple, args=(2,)),
    }


async def peer_killed(cfg: Config) -> dict[str, Any]:
    """Rank 1 dies (SIGKILL) in the middle of a call from rank 0."""
    await cfg.join(rpc_timeout=30)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        slow = asyncrpc.rpc_async("w1", sleep_for, args=(25,))
        # A burst in one turn: its small requests travel in BATCH frames.
        burst = [asyncrpc.rpc_async("w1", sleep_for, args=(25,)) for _ in range(200)]
        started = time.monotonic()
        seen["killed"] = await outcome(asyncrpc.rpc_async("w1", die))
        seen["in_flight"] = await outcome(slow)
        outcomes = await asyncio.gather(*(outcome(call) for call in burst))
        seen["burst_errors"] = sorted({each.get("error", "returned") for each in outcomes})
        seen["elapsed"] = time.monotonic() - started
        seen["later_call"] = await outcome(asyncrpc.rpc_async("w1", whoami))
        seen["pending_after"] = asyncrpc.get_debug_info()["pending_outgoing_calls"]
        started = time.monotonic()
        await asyncrpc.shutdown(timeout=20)
        seen["shutdown_seconds"] = time.monotonic() - started
    else:
        await asyncio.sleep(60)  # killed long before
    return seen


DROP_WITHIN = 5.0
"""Seconds a worker may take to drop a connection for what it sent (it does so at once;
generous for a loaded machine, and far below the scenario's handshake timeout, so that a
connection the worker ignored is still open when the probe gives up)."""


class RunOnLoad:
    """Unpickling this runs a shell command: what an attacker's pickle would do."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


async def bad_input(cfg: Config) -> dict[str, Any]:
    """Rank 0 throws hostile bytes at rank 1's listener, each on a connection it keeps
    open for writing: rank 1 must drop that connection because of the bytes (and only
    it), run nothing they carry, and keep serving."""
    # Longer than the whole job: no connection here ends by the handshake timeout.
    await cfg.join(rpc_timeout=20, handshake_timeout=120)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        address = _resolve("w1").addresses["tcp"].removeprefix("tcp://")
        host, port = address.rsplit(":", 1)
        marks = Path(tempfile.mkdtemp(prefix="asyncrpc-bad-input-"))
        seen.update(await _throw_hostile_bytes((host, int(port)), f"touch {marks / 'ran'}"))
        seen["command_ran"] = (marks / "ran").exists()
        # Control: the same command, called by an authenticated peer, leaves its mark.
        await asyncrpc.rpc_async("w1", os.system, args=(f"touch {marks / 'control'}",))
        seen["control_command_ran"] = (marks / "control").exists()
        shutil.rmtree(marks)
    await asyncrpc.shutdown()
    return seen


async def _throw_hostile_bytes(address: tuple[str, int], command: str) -> dict[str, Any]:
    """How w1 ended each hostile connection, and the state of two it should leave open:
    a silent one and one with a frame cut short (until we end the stream)."""
    seen: dict[str, Any] = {}
    bystander = await _connect(address)
    truncated = await _connect(address)
    await _send(truncated, struct.pack("<HHI", 0xA5C1, 0, 40) + b"\x94\x01")
    for name, data in _hostile_inputs(command).items():
        with await _connect(address) as sock:
            await _send(sock, data)
            seen[name] = await _how_it_ends(sock)
    seen["wrong_secret"] = await _wrong_secret_dial(_resolve("w1"))
    seen["still_serving"] = await asyncrpc.rpc_async("w1", whoami)
    seen["bystander"] = _state(bystander)
    seen["truncated_before_eof"] = _state(truncated)
    truncated.shutdown(socket.SHUT_WR)
    seen["truncated"] = await _how_it_ends(truncated)
    bystander.close()
    truncated.close()
    return seen


def _resolve(name: str) -> Any:
    from asyncrpc.agent import current_agent

    agent = current_agent()
    assert agent is not None
    return agent.resolve(name)


def _hostile_inputs(command: str) -> dict[str, bytes]:
    """What an unauthenticated peer might send; each must get its connection dropped."""
    from asyncrpc.wire import PROTOCOL_VERSION, Kind, encode_frame

    def frame(kind: Kind, meta: dict[str, Any], payload: bytes = b"") -> bytes:
        return b"".join(bytes(p) for p in encode_frame(kind, meta, payload))

    call = pickle.dumps((os.system, (RunOnLoad(command),), {}))
    request = frame(Kind.REQUEST, {"i": 1, "f": "os.system"}, call)
    hello = {
        "v": PROTOCOL_VERSION,
        "name": "x",
        "rank": 7,
        "pid": 1,
        "host": "h",
        "nonce": b"\0" * 32,
    }
    return {
        "garbage": b"\x00\xffnot a frame at all" * 50,
        "oversized_header": struct.pack("<HHI", 0xA5C1, 0, 1 << 30),
        "request_before_handshake": request,
        "request_mid_handshake": frame(Kind.HELLO, {**hello, "max_frame_size": 1 << 20}) + request,
    }


async def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET)
    sock.setblocking(False)
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, address), DROP_WITHIN)
    return sock


async def _send(sock: socket.socket, data: bytes) -> None:
    await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(sock, data), DROP_WITHIN)


async def _how_it_ends(sock: socket.socket) -> dict[str, Any]:
    """Read what the worker sends until it closes the connection ("dropped") or
    DROP_WITHIN passes ("open": it ignored what we sent)."""
    loop = asyncio.get_running_loop()
    received = 0
    try:
        async with asyncio.timeout(DROP_WITHIN):
            while chunk := await loop.sock_recv(sock, 1 << 16):
                received += len(chunk)
    except TimeoutError:
        return {"ended": "open", "received": received}
    except ConnectionResetError:
        pass
    return {"ended": "dropped", "received": received}


def _state(sock: socket.socket) -> str:
    """Whether the worker left ``sock`` open (and silent), without waiting."""
    try:
        data = sock.recv(1)
    except BlockingIOError:
        return "open"
    except ConnectionResetError:
        return "dropped"
    return "dropped" if data == b"" else "sent data"


async def _wrong_secret_dial(target: Any) -> dict[str, Any]:
    from asyncrpc.agent import AgentOptions, RpcAgent

    intruder = RpcAgent("intruder", 99, b"not the job secret", AgentOptions(transports=("tcp",)))
    await intruder.start()
    intruder.join([intruder.address, target])
    result = await outcome(intruder.rpc_async(target.name, whoami, timeout=10))
    await intruder.shutdown(graceful=False)
    return result


async def graceful_shutdown(cfg: Config) -> dict[str, Any]:
    """Rank 1 calls shutdown at once; rank 0 still calls it for a while and must succeed."""
    await cfg.join(rpc_timeout=30)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        results = []
        for i in range(20):
            results.append(await asyncrpc.rpc_async("w1", double, args=(i,)))
            await asyncio.sleep(0.01)  # pacing the caller, not synchronising anything
        seen["results"] = results
    from asyncrpc.agent import current_agent

    agent = current_agent()
    assert agent is not None
    started = time.monotonic()
    await asyncrpc.shutdown()
    seen["shutdown_seconds"] = time.monotonic() - started
    after = agent.debug_info()
    state = after["state"]
    seen["state"] = str(getattr(state, "name", state)).lower()  # a string, or an Enum's name
    seen["pending_outgoing_calls"] = after["pending_outgoing_calls"]
    return seen


def blake(x: torch.Tensor) -> str:
    """A digest of a tensor's bytes (a remote function: the data arrived intact?)."""
    return hashlib.blake2b(memoryview(x.numpy()).cast("B")).hexdigest()


class LoopWatch:
    """Samples, every 10 ms, how late the event loop wakes and what shared memory the
    worker holds (lent plus idle), until stopped."""

    def __init__(self) -> None:
        self.max_lag = 0.0
        self.max_held = 0
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            started = loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.01)
            if not self._stop.is_set():
                self.max_lag = max(self.max_lag, loop.time() - started - 0.01)
            shm = asyncrpc.get_debug_info()["shared_memory"]
            self.max_held = max(self.max_held, shm["bytes_in_use"] + shm["bytes_idle"])

    async def stop(self) -> None:
        self._stop.set()
        await self._task


async def shm_budget(cfg: Config) -> dict[str, Any]:
    """Rank 0 sends 40 concurrent 8 MiB tensors to rank 1 with a 64 MiB shared-memory
    budget, watching its own loop and shared memory; rank 1 answers with digests."""
    budget = 64 << 20
    await cfg.join(rpc_timeout=60, shared_memory_budget=budget)
    seen: dict[str, Any] = {"budget": budget}
    if cfg.rank == 0:
        tensors = [
            torch.randint(0, 2**31 - 1, (2 << 20,), dtype=torch.int32, generator=_seeded(i))
            for i in range(40)
        ]
        watch = LoopWatch()
        started = time.monotonic()
        calls = [asyncrpc.rpc_async("w1", blake, args=(t,)) for t in tensors]
        seen["issue_seconds"] = time.monotonic() - started
        answers = await asyncio.gather(*calls)
        await watch.stop()
        seen["correct"] = answers == [blake(t) for t in tensors]
        seen["max_loop_lag"] = watch.max_lag
        seen["max_held_bytes"] = watch.max_held
        seen["shm"] = asyncrpc.get_debug_info()["shared_memory"]
    await asyncrpc.shutdown()
    return seen


def keep_until_exit(x: torch.Tensor) -> torch.Tensor:
    """Keep what arrived (through shared memory, if large) until the interpreter exits,
    and send back a tensor of the same size, which the caller keeps so too."""
    _keep_until_exit("argument", x)
    return x + 1


def _keep_until_exit(key: str, value: Any) -> None:
    """Hold ``value`` where the interpreter lets go of it last, after it has torn down
    every module of asyncrpc (a user's module global may go then or earlier, depending
    on the order of imports): on ``sys`` itself."""
    kept = getattr(sys, "_asyncrpc_kept_until_exit", {})
    kept[key] = value
    sys._asyncrpc_kept_until_exit = kept  # type: ignore[attr-defined]


async def keep_received_until_exit(cfg: Config) -> dict[str, Any]:
    """Rank 0 sends rank 1 an 8 MiB tensor, which rank 1 keeps until its interpreter
    exits, as rank 0 keeps the reply; both shut down and exit holding them (rank 0
    reports the shared memory it lent and rank 1 still holds)."""
    await cfg.join(rpc_timeout=30)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        reply = await asyncrpc.rpc_async("w1", keep_until_exit, args=(torch.zeros(2 << 20),))
        _keep_until_exit("reply", reply)
        seen["reply_sum"] = float(reply.sum())
        seen["lent_bytes"] = asyncrpc.get_debug_info()["shared_memory"]["bytes_in_use"]
    await asyncrpc.shutdown()
    return seen


async def leave_holding_an_rref(cfg: Config) -> dict[str, Any]:
    """Rank 0 keeps an RRef that rank 1 owns where the interpreter lets go of it last,
    and leaves without shutdown (as a job that fails does); rank 1 shuts down."""
    await cfg.join(rpc_timeout=30)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        rref = asyncrpc.remote("w1", add, args=(2, 3))
        seen["value"] = await rref.to_here()
        _keep_until_exit("rref", rref)
        return seen
    await asyncrpc.shutdown()
    return seen


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


LATE_START_S = 1.0
"""How much later the last rank of ``late_rank`` starts than the others."""


async def late_rank(cfg: Config) -> dict[str, Any]:
    """The last rank starts ``LATE_START_S`` after the others (a job's processes seldom
    start together: several hosts, a slow import); then each rank calls the next."""
    if cfg.rank == cfg.world - 1:
        await asyncio.sleep(LATE_START_S)  # the scenario itself: this rank comes late
    await cfg.join(rpc_timeout=30)
    seen = {"next_says": await asyncrpc.rpc_async(f"w{(cfg.rank + 1) % cfg.world}", whoami)}
    await asyncrpc.shutdown()
    return seen


async def rendezvous(cfg: Config) -> dict[str, Any]:
    """Join through the init_method in $TEST_INIT_METHOD (env://, file://, ...)."""
    name = os.environ.get("TEST_WORKER_NAME", cfg.name)
    try:
        await asyncrpc.init_rpc(
            name,
            rank=cfg.rank,
            world_size=int(os.environ.get("TEST_WORLD_SIZE", str(cfg.world))),
            init_method=os.environ.get("TEST_INIT_METHOD", f"tcp://127.0.0.1:{cfg.port}"),
            rpc_timeout=float(os.environ.get("TEST_RPC_TIMEOUT", "15")),
        )
    except Exception as exc:
        return {"init_error": type(exc).__name__, "message": str(exc)}
    peer = f"w{1 - cfg.rank}"
    seen = {"peer_says": await asyncrpc.rpc_async(peer, whoami)}
    await asyncrpc.shutdown()
    return seen


async def rendezvous_beside_process_group(cfg: Config) -> dict[str, Any]:
    """env:// in processes whose default process group already serves MASTER_PORT."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", rank=cfg.rank, world_size=cfg.world)
    try:
        await asyncrpc.init_rpc(cfg.name, rank=cfg.rank, world_size=cfg.world, rpc_timeout=15)
        seen = {"peer_says": await asyncrpc.rpc_async(f"w{1 - cfg.rank}", whoami)}
        await asyncrpc.shutdown()
        dist.barrier()  # the group still works
    finally:
        dist.destroy_process_group()
    return seen


async def ddp_in_autograd_context(cfg: Config) -> dict[str, Any]:
    """Two DDP replicas trained through distributed autograd stay equal, and their
    gradients are the average of what each would compute alone."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from asyncrpc import autograd

    dist.init_process_group("gloo", init_method="env://", rank=cfg.rank, world_size=cfg.world)
    await asyncrpc.init_rpc(cfg.name, rank=cfg.rank, world_size=cfg.world, rpc_timeout=30)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    seen: dict[str, Any] = {"steps": []}
    for step in range(3):  # DDP's next forward must not find a reduction still pending
        batch = torch.full((4, 3), float(cfg.rank + step + 1))
        alone = torch.autograd.grad(model.module(batch).sum(), list(model.module.parameters()))
        async with autograd.context() as ctx:
            remote_part = await asyncrpc.rpc_async(f"w{1 - cfg.rank}", torch.mul, args=(batch, 1))
            loss = model(remote_part.requires_grad_()).sum()
            await autograd.backward(ctx, [loss])
            grads = autograd.get_gradients(ctx)
            got = [grads[p] for p in model.module.parameters()]
        seen["steps"].append(
            {"alone": [g.tolist() for g in alone], "got": [g.tolist() for g in got]}
        )
    await asyncrpc.shutdown()
    dist.destroy_process_group()
    return seen
