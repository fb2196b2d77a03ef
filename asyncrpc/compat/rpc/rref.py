"""torch's ``RRef`` and ``WorkerInfo`` over asyncrpc's, with blocking methods.

Theory of operation
-------------------
:class:`RRef` subclasses :class:`asyncrpc.RRef`, so the native reference
counting, pickling and owner-side handling apply unchanged; only the methods a
user calls differ: they block (``to_here``, ``rpc_sync()``) or return
``torch.futures.Future`` (``rpc_async()``) instead of awaitables, through
:mod:`asyncrpc.compat._runtime`.  While compat runs, every handle this process
makes (by ``remote()``, by receiving one in a message) is of this class
(``RRefContext.handle_type``), so RRefs arriving in arguments are torch-style too.
Native code that receives such a handle calls the base class's methods
explicitly (``asyncrpc.RRef.to_here(handle)``).

:class:`WorkerInfo` subclasses asyncrpc's with torch's constructor order
``WorkerInfo(name, worker_id)``; it equals and hashes like any WorkerInfo of the
same worker, and pickles.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

import asyncrpc.api as native_api
from asyncrpc.agent import WorkerInfo as NativeWorkerInfo
from asyncrpc.agent import validate_name
from asyncrpc.compat import _runtime
from asyncrpc.compat.errors import RRefError, SerializationError, convert
from asyncrpc.compat.rpc.constants import UNSET_RPC_TIMEOUT
from asyncrpc.rref import RRef as NativeRRef

__all__ = ("RRef", "WorkerInfo", "worker_info")

T = TypeVar("T")


class WorkerInfo(NativeWorkerInfo):
    """A worker: ``name`` and ``id`` (its rank).  ``WorkerInfo(name, worker_id)``."""

    __slots__ = ()

    def __init__(self, name: str, worker_id: int) -> None:
        check_name(name)
        if not isinstance(worker_id, int) or worker_id < 0:
            raise RuntimeError(f"worker id must be a non-negative integer, not {worker_id!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "id", worker_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NativeWorkerInfo):
            return NotImplemented
        return (self.id, self.name) == (other.id, other.name)

    def __hash__(self) -> int:
        return hash((self.id, self.name))

    def __reduce__(self) -> Any:
        return WorkerInfo, (self.name, self.id)

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


def check_name(name: object) -> None:
    """Raise torch's ``RuntimeError`` unless ``name`` is a legal worker name (asyncrpc's
    rule: 1 to 127 of letters, digits, ``_ : - .``)."""
    try:
        validate_name(name)
    except ValueError as exc:
        if name == "":
            raise RuntimeError("Worker name must be non-empty") from exc
        if isinstance(name, str) and len(name) >= _MAX_NAME_LEN:
            raise RuntimeError(
                f"RPC worker name {name[:32]}... ({len(name)} characters) is not shorter "
                f"than {_MAX_NAME_LEN}"
            ) from exc
        raise RuntimeError(f"Worker name must match ^[A-Za-z0-9_:.-]*$, got {name!r}") from exc


_MAX_NAME_LEN = 128  # torch's bound (exclusive), and asyncrpc's


def worker_info(info: NativeWorkerInfo) -> WorkerInfo:
    """The compat WorkerInfo of a native one."""
    return info if isinstance(info, WorkerInfo) else WorkerInfo(info.name, info.id)


class RRef(NativeRRef[T]):
    """A reference to a value on its owner, with torch's blocking methods.

    ``RRef(value)`` makes this worker the owner of ``value``.
    """

    __slots__ = ("_value_type",)

    def __init__(self, value: T, type_hint: Any = None) -> None:
        _runtime.call(lambda: NativeRRef.__init__(self, value), "RRef()")

    def __reduce__(self) -> Any:
        raise SerializationError(
            f"Can not pickle rref in python pickler, rref can only be pickled when using RPC "
            f"({self!r} pickles only into asyncrpc calls)"
        )

    def __str__(self) -> str:
        """torch's form: ``OwnerRRef(GloballyUniqueId(...))`` on the owner,
        ``UserRRef(RRefId = ..., ForkId = ...)`` elsewhere."""
        if self.is_owner():
            return f"OwnerRRef({_unique_id(self._id)})"
        return f"UserRRef(RRefId = {_unique_id(self._id)}, ForkId = {_unique_id(self._fork())})"

    def _fork(self) -> tuple[int, int] | None:
        """This worker's fork of the RRef (None once released)."""
        held = self._context.state.held.get(self._id)
        return None if held is None else held.fork

    def owner(self) -> WorkerInfo:
        """The owner's WorkerInfo."""
        return worker_info(super().owner())

    def local_value(self) -> T:
        """The value itself, on the owner (waiting for it to be made, as torch does,
        except on the event loop thread); elsewhere ``RuntimeError``."""
        if not self.is_owner():
            raise RRefError(
                f"For UserRRef(rref_id={_unique_id(self._id)}, "
                f"fork_id={_unique_id(self._fork())}), can't call localValue() on user "
                f"{worker_info(self._context.agent.info)!r}. Call it on owner {self.owner()!r} "
                "(or use to_here() here)"
            )
        if _runtime.is_running() and not _runtime.running().on_loop_thread():
            return _runtime.run(lambda: NativeRRef.to_here(self), "RRef.local_value()")
        try:
            return super().local_value()
        except Exception as exc:
            raise convert(exc) from None

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:  # type: ignore[override]  # torch's blocking form
        """A copy of the value (the value itself on the owner); blocks."""
        if self._context.closed:
            raise RRefError(
                f"{self} was deleted by shutdown() (its worker's RRefs are released). "
                "Cannot call to_here() on it after deletion."
            )
        seconds = _runtime.value_or_none(timeout)
        return _runtime.run(lambda: NativeRRef.to_here(self, seconds), f"{self!r}.to_here()")

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:  # type: ignore[override]  # torch's blocking form
        """``rref.rpc_sync().method(*a, **kw)``: run the method on the owner; blocks."""
        return _Proxy(self, "rpc_sync", _runtime.value_or_none(timeout))

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:  # type: ignore[override]  # torch's blocking form
        """``rref.rpc_async().method(*a, **kw)``: a ``torch.futures.Future`` of the result."""
        return _Proxy(self, "rpc_async", _runtime.value_or_none(timeout))

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:  # type: ignore[override]  # torch's blocking form
        """``rref.remote().method(*a, **kw)``: an RRef, on the owner, of the result."""
        return _Proxy(self, "remote", _runtime.value_or_none(timeout))

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:  # type: ignore[override]  # torch's blocking form
        """Backward pass from the RRef's scalar value: distributed, in context
        ``dist_autograd_ctx_id``; or, with ``-1`` and only on the owner, local autograd."""
        if dist_autograd_ctx_id == -1:
            if not self.is_owner():
                raise RRefError(
                    f"User RRefs require 'dist_autograd_ctx_id' to be specified ({self!r} "
                    "is owned elsewhere: local autograd runs only on its owner)"
                )
            _local_backward(self.local_value(), retain_graph)
            return
        context_id = dist_autograd_ctx_id
        from asyncrpc.compat.autograd import (  # noqa: PLC0415  # it imports us
            _retrieve_context,
            run_engine,
        )

        _retrieve_context(context_id)  # torch's error for an unknown context, before sending
        run_engine(
            lambda: NativeRRef.backward(self, context_id, retain_graph), f"{self!r}.backward()"
        )

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True) -> Any:
        """The type of the value (torch's private helper); a future if not ``blocking``."""
        if self.is_owner():
            future = _runtime.done_future(type(self.local_value()))
        else:
            seconds = _runtime.value_or_none(timeout)
            future = _runtime.start_torch_future(
                lambda: native_api.rpc_async(self._owner, _value_type, (self,), timeout=seconds),
                f"{self!r}._get_type()",
            )
        return future.wait() if blocking else future

    def _check_method(self, method: str, timeout: float | None) -> None:
        """torch looks ``method`` up on the value's type (fetched once per handle) before
        ``rref.remote().method()`` sends anything, so a missing one is an
        ``AttributeError`` at once.  Not on the loop thread, which must not block: there
        the RRef's first use raises it."""
        if _runtime.running().on_loop_thread():
            return
        value_type = getattr(self, "_value_type", None)
        if value_type is None:
            value_type = self._value_type = self._get_type(
                UNSET_RPC_TIMEOUT if timeout is None else timeout
            )
        getattr(value_type, method)


def _unique_id(id_: tuple[int, int] | None) -> str:
    """An RRef or fork id as torch prints it."""
    if id_ is None:
        return "None"
    return f"GloballyUniqueId(created_on={id_[0]}, local_id={id_[1]})"


def _local_backward(value: object, retain_graph: bool) -> None:
    """Local autograd from an RRef's scalar value (``.grad`` accumulates)."""
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(
            f"RRef should contain a tensor for .backward(), not a {type(value).__name__}"
        )
    torch.autograd.backward(value, retain_graph=retain_graph)


async def _value_type(rref: NativeRRef[Any]) -> type:
    """On the owner: the type of the RRef's value, once made."""
    return type(await NativeRRef.to_here(rref))


class _Proxy:
    """What ``rref.rpc_sync()`` and friends return: attribute access picks the method."""

    __slots__ = ("_kind", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], kind: str, timeout: float | None) -> None:
        self._rref, self._kind, self._timeout = rref, kind, timeout

    def __getattr__(self, method: str) -> Any:
        rref, kind, timeout = self._rref, self._kind, self._timeout
        what = f"{rref!r}.{kind}().{method}"

        def call(*args: Any, **kwargs: Any) -> Any:
            if kind == "remote":
                rref._check_method(method, timeout)
                proxy = NativeRRef.remote(rref, timeout)
                return _runtime.call(lambda: getattr(proxy, method)(*args, **kwargs), what)
            native = NativeRRef.rpc_async(rref, timeout)
            start = lambda: getattr(native, method)(*args, **kwargs)  # noqa: E731
            if kind == "rpc_async":
                return _runtime.start_torch_future(start, what)
            return _runtime.run(start, what)

        call.__name__ = method
        return call
