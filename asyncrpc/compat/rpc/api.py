"""torch.distributed.rpc's blocking API over asyncrpc (``import asyncrpc.compat.rpc as rpc``).

Theory of operation
-------------------
``init_rpc`` starts the compat loop thread (:mod:`asyncrpc.compat._runtime`) and
awaits asyncrpc's own ``init_rpc`` there; every other function hands its work to
that loop: ``rpc_sync`` waits for the native call, ``rpc_async`` returns a
``torch.futures.Future`` bridged from the native asyncio future, ``remote``
returns an RRef at once.  Timeouts keep torch's meanings (``-1``/unset: the
default; ``0``: none) and errors come out as torch raises them (see
:mod:`asyncrpc.compat.errors`).  No RPC logic lives here: each function is the
native one, called on the loop.

A process runs either compat or the native API: ``init_rpc`` here refuses to run
beside a native agent, and native ``init_rpc`` refuses to run beside this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, cast

import torch
from torch.jit._builtins import _find_builtin as _find_untyped

import asyncrpc.api as native_api
from asyncrpc.agent import Lifecycle, current_agent
from asyncrpc.agent.dispatch import function_name
from asyncrpc.compat import _runtime
from asyncrpc.compat._private import private_getattr
from asyncrpc.compat.errors import ConfigurationError, OperatorError, convert
from asyncrpc.compat.rpc.backend_registry import BackendType
from asyncrpc.compat.rpc.constants import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT
from asyncrpc.compat.rpc.options import RpcBackendOptions, TensorPipeRpcBackendOptions
from asyncrpc.compat.rpc.rref import RRef, WorkerInfo, worker_info
from asyncrpc.errors import AgentStateError
from asyncrpc.rref import remote as native_remote
from asyncrpc.rref.context import RRefContext

__all__ = (
    "get_worker_info",
    "init_rpc",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
)

_find_builtin: Callable[[object], str | None] = _find_untyped  # torch's table of operators
_thread_local_var = threading.local()  # torch's: `_wait_all` collects futures in it
_ignore_rref_leak = True  # torch's flag; asyncrpc checks leaks in its own tests


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Join the job as worker ``name`` (torch's signature; ``backend`` is ignored:
    asyncrpc is the backend).  ``rank=-1`` and ``world_size=None`` read ``RANK`` and
    ``WORLD_SIZE``; the options give ``init_method``, ``rpc_timeout`` and
    ``num_worker_threads``.  Blocks until every worker has joined."""
    _check_arguments(backend, rpc_backend_options)
    options = rpc_backend_options or TensorPipeRpcBackendOptions()
    if _runtime.is_running():
        raise AgentStateError("RPC is already initialized: call shutdown() first")
    native = current_agent()
    if native is not None and native.state is not Lifecycle.CLOSED:
        raise AgentStateError(
            "a native asyncrpc agent runs in this process: use either asyncrpc.compat or "
            "the native asyncrpc API in one process, not both"
        )
    threads = getattr(options, "num_worker_threads", 16)
    _runtime.start(threads)
    RRefContext.handle_type = RRef  # before joining: peers may call us at once
    _failed_calls.show()
    try:
        _join(
            lambda: native_api.init_rpc(
                name,
                rank=None if rank is None or rank < 0 else rank,
                world_size=world_size,
                init_method=options.init_method,
                rpc_timeout=options.rpc_timeout,
                num_worker_threads=threads,
                device_maps=getattr(options, "device_maps", None),
                devices=getattr(options, "devices", None),
            )
        )
    except BaseException:
        RRefContext.handle_type = None
        _failed_calls.hide()
        _runtime.stop()
        raise


class _StderrHandler(logging.StreamHandler[Any]):
    """Writes to whatever ``sys.stderr`` is when a record comes (torch prints there)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


class _FailedCalls:
    """torch prints a user function's exception on the callee's stderr; asyncrpc logs it
    (``asyncrpc.agent.calls``, INFO): while compat runs, those records go to stderr."""

    def __init__(self) -> None:
        self.handler = _StderrHandler()
        self.handler.setLevel(logging.INFO)
        self.logger = logging.getLogger("asyncrpc.agent.calls")
        self.set_level = False

    def show(self) -> None:
        self.logger.addHandler(self.handler)
        if self.logger.level == logging.NOTSET:  # (a level the user chose is kept)
            self.logger.setLevel(logging.INFO)
            self.set_level = True

    def hide(self) -> None:
        self.logger.removeHandler(self.handler)
        if self.set_level:
            self.logger.setLevel(logging.NOTSET)
            self.set_level = False


_failed_calls = _FailedCalls()


def _join(start: Callable[[], Awaitable[None]]) -> None:
    """Run the native ``init_rpc``; a bad name, rank or world size, or a name two
    workers share, is torch's ``RuntimeError`` (and still a ``ValueError``)."""
    try:
        _runtime.run(start, "init_rpc")
    except ValueError as exc:
        if isinstance(exc, RuntimeError):
            raise
        raise ConfigurationError(str(exc)) from exc


def _check_arguments(backend: Any, options: Any) -> None:
    """torch's checks of ``init_rpc``'s argument types, before anything starts."""
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(
            f"Argument backend must be a member of BackendType, not {type(backend).__name__}"
        )
    if options is not None and not isinstance(options, RpcBackendOptions):
        raise TypeError(
            "Argument rpc_backend_options must be an instance of RpcBackendOptions, not "
            f"{type(options).__name__}"
        )


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Leave the job.  Graceful: wait for every worker to call shutdown too, release
    RRefs, then close.  ``timeout=0`` (torch's default) waits as long as the others
    live; a positive number bounds it."""
    bound = None if timeout <= 0 else float(timeout)
    try:
        _runtime.run(lambda: native_api.shutdown(graceful, bound), "shutdown")
    finally:
        RRefContext.handle_type = None
        _failed_calls.hide()
        _runtime.stop()


def rpc_sync(
    to: str | int | WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result (blocks).
    ``timeout``: seconds; ``-1`` (unset) the default, ``0`` none."""
    seconds = _runtime.value_or_none(timeout)
    return _runtime.run(
        lambda: native_api.rpc_async(to, _callable(func), _args(args), kwargs, seconds),
        f"rpc_sync to {to}",
    )


def rpc_async(
    to: str | int | WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> _runtime.Future[Any]:
    """Start ``func(*args, **kwargs)`` on worker ``to``; returns a ``torch.futures.Future``."""
    seconds = _runtime.value_or_none(timeout)
    future = _runtime.start_torch_future(
        lambda: native_api.rpc_async(to, _callable(func), _args(args), kwargs, seconds),
        f"rpc_async to {to}",
    )
    collected = getattr(_thread_local_var, "future_list", None)
    if collected is not None:
        collected.append(future)
    return future


def remote(
    to: str | int | WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[Any]:
    """Run ``func`` on worker ``to`` and keep the result there; returns its RRef at once."""
    seconds = _runtime.value_or_none(timeout)
    rref = _runtime.call(
        lambda: native_remote(to, _callable(func), _args(args), kwargs, seconds), f"remote to {to}"
    )
    return cast(RRef[Any], rref)  # compat makes every handle an RRef


def _args(args: Any) -> tuple[Any, ...]:
    return () if args is None else tuple(args)


def _callable(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func``, or, for a torch operator (``torch.add``), a wrapper that reports
    arguments matching none of its schemas as torch does (see :class:`_Operator`)."""
    if _find_builtin(func) is not None:
        return _Operator(func)
    return func


class _Operator:
    """A torch operator sent by compat.  torch runs an operator called by RPC by its
    schema, so arguments that match none is a ``RuntimeError`` ("Overloaded torch
    operator invoked from Python failed to match any schema"): here an
    :class:`~asyncrpc.compat.errors.OperatorError`, which is also the ``TypeError``
    Python raises."""

    __slots__ = ("op", "rpc_name")

    def __init__(self, op: Callable[..., Any]) -> None:
        self.op = op
        self.rpc_name = function_name(op)

    def __reduce__(self) -> Any:
        return _Operator, (self.op,)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.op(*args, **kwargs)
        except TypeError as exc:
            if isinstance(exc, RuntimeError):
                raise
            raise OperatorError(
                f"Overloaded torch operator invoked from Python failed to match any schema: {exc}"
            ) from exc


def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """The WorkerInfo of ``worker_name``, or of this worker when None."""
    try:
        return worker_info(native_api.get_worker_info(worker_name))
    except Exception as exc:
        raise convert(exc) from None


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds."""
    return _runtime.agent().options.rpc_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout of later calls (torch's private helper)."""
    agent = _runtime.agent()
    agent.options = dataclasses.replace(agent.options, rpc_timeout=float(rpc_timeout))


def _worker_infos() -> list[WorkerInfo]:
    agent = _runtime.agent()
    infos: list[WorkerInfo] = []
    rank = 0
    while True:
        try:
            infos.append(worker_info(agent.resolve(rank).info))
        except Exception:
            return infos
        rank += 1


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
    """Wait, on leaving the block, for every ``rpc_async`` future this thread made in it."""
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def _get_debug_info() -> dict[str, Any]:
    """asyncrpc's debug info (torch's private helper; asyncrpc's keys)."""
    return native_api.get_debug_info()


def _rref_context_get_debug_info() -> dict[str, str]:
    """RRef counts under torch's keys: owners, forks held (values are strings)."""
    info = native_api.get_debug_info()
    return {
        "num_owner_rrefs": str(info.get("owner_rrefs", 0)),
        "num_forks": str(info.get("user_rrefs", 0)),
        "num_pending_futures": "0",
        "num_pending_users": "0",
    }


class _CurrentAgent:
    """What torch's ``_get_current_rpc_agent()`` offers that asyncrpc can answer."""

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        return get_worker_info(worker_name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        return _worker_infos()

    def get_debug_info(self) -> dict[str, Any]:
        return _get_debug_info()

    def get_rpc_timeout(self) -> float:
        return get_rpc_timeout()


def _get_current_rpc_agent() -> _CurrentAgent:
    """torch's private accessor, answering ``get_worker_infos()`` and the like."""
    _runtime.agent()
    return _CurrentAgent()


__getattr__ = private_getattr("torch.distributed.rpc.api")


# -- torch's private barriers, over RPC to a leader (the first name) -------------------

_arrivals = threading.Condition()
_arrived: dict[tuple[tuple[str, ...], int], set[str]] = {}
_left: dict[tuple[tuple[str, ...], int], int] = {}  # callers released from a round so far
_rounds: dict[tuple[str, ...], int] = {}


def _barrier(worker_names: list[str] | set[str], timeout: float = UNSET_RPC_TIMEOUT) -> None:
    """Block until every worker of ``worker_names`` has called ``_barrier`` with the
    same names (torch's private helper); bounded by ``timeout`` (default
    ``rpc_timeout``)."""
    names = tuple(sorted(worker_names))
    with _arrivals:
        round_ = _rounds[names] = _rounds.get(names, 0) + 1
    seconds = get_rpc_timeout() if timeout < 0 else float(timeout)
    me = get_worker_info().name
    rpc_sync(names[0], _arrive, args=(names, round_, me, seconds), timeout=0)


def _wait_all_workers(timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Block until every worker of the job has called it (torch's private helper)."""
    _barrier([info.name for info in _worker_infos()], timeout if timeout > 0 else -1)


def _arrive(names: tuple[str, ...], round_: int, who: str, timeout: float) -> None:
    """On the leader, in a pool thread: wait until all ``names`` arrived in ``round_``."""
    key = (names, round_)
    with _arrivals:
        _arrived.setdefault(key, set()).add(who)
        _arrivals.notify_all()
        if not _arrivals.wait_for(lambda: len(_arrived[key]) == len(names), timeout or None):
            missing = sorted(set(names) - _arrived[key])
            raise RuntimeError(f"barrier timed out after {timeout}s waiting for {missing}")
        _left[key] = _left.get(key, 0) + 1
        if _left[key] == len(names):  # the round's last caller out forgets it
            del _arrived[key], _left[key]
