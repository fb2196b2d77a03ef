"""How an incoming call runs, and how its outcome becomes a reply.

Theory of operation
-------------------
The function decides where it runs:

* ``async def`` functions run as tasks on the worker's event loop;
* functions marked :func:`async_execution` run on the loop and return an
  awaitable (an asyncio future, a coroutine, or a ``torch.futures.Future``);
  the reply leaves when it completes, and no thread is held meanwhile;
* functions marked :func:`on_loop` (quick, non-blocking bookkeeping such as
  the RRef protocol's messages) run on the loop at once; their return value is
  the reply;
* every other callable runs in the worker's thread pool, so torch compute
  never blocks the loop.  Its result is also serialised in that thread.

An outcome is packed as RESPONSE (the pickled result) or ERROR (the pickled
exception, the worker, the function and the remote traceback text).  An
exception that does not survive a pickle round trip travels as
:class:`RemoteError` with its type name and message, so a reply is never lost.
So does one that is no ``Exception`` (``KeyboardInterrupt``, ``SystemExit``):
raised in remote code it ends that call, not the callee, and the caller gets
an error its ``except Exception`` catches, as torch.distributed.rpc does.
"""

from __future__ import annotations

import inspect
import traceback
import types
from collections.abc import Callable
from enum import Enum, auto
from typing import Any, TypeVar

from asyncrpc.errors import RemoteError
from asyncrpc.serde import dumps, loads

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "_asyncrpc_async_execution"
_ON_LOOP = "_asyncrpc_on_loop"


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning an awaitable whose result is the RPC's reply.

    The function runs on the callee's event loop and must not block; it returns
    an ``asyncio.Future``, a coroutine or a ``torch.futures.Future``.  The reply
    is sent when that completes, so thousands of calls can wait (for a batch to
    fill, say) without holding a thread.  Put it innermost under
    ``@staticmethod``/``@classmethod``, as in torch.distributed.rpc.
    """
    setattr(fn, _MARK, True)
    return fn


def on_loop(fn: F) -> F:
    """Mark ``fn`` to run on the callee's event loop as soon as the request arrives.

    For short, non-blocking functions only (framework bookkeeping): no task and
    no thread hop, and the return value is the reply.
    """
    setattr(fn, _ON_LOOP, True)
    return fn


class Placement(Enum):
    """Where an incoming call runs."""

    THREAD = auto()  # plain callables: the worker's thread pool
    LOOP = auto()  # async def: a task on the event loop
    AWAITABLE = auto()  # @async_execution: on the loop, reply when its awaitable completes
    INLINE = auto()  # @on_loop: called on the loop at once, its return value is the reply


_KEPT = 1024  # functions described and kept (forgotten all at once past this)
_described: dict[Any, tuple[Placement, str]] = {}
_KEEPABLE = (types.FunctionType, types.BuiltinFunctionType)


def describe(fn: Any) -> tuple[Placement, str]:
    """Where ``fn`` runs and its readable name.  Kept for functions and builtins found by
    their name (and so for Python methods, which run as their function would), not for
    one made at run time, a lambda or a nested function (the cache would keep it alive,
    and everything it closes over: ``remote()`` to oneself with a lambda that closes over
    a tensor, each step), nor for bound builtin methods such as ``tensor.add_`` (it
    would keep their object alive)."""
    try:
        cached = _described.get(fn)  # (only keepable callables are ever kept)
    except TypeError:  # an unhashable callable object
        cached = None
    if cached is not None:
        return cached
    if isinstance(fn, types.MethodType):  # a Python method runs as its function would
        return describe(fn.__func__)
    found = (_placement(fn), _name_of(fn))
    if _keepable(fn):
        if len(_described) >= _KEPT:
            _described.clear()
        _described[fn] = found
    return found


def _keepable(fn: Any) -> bool:
    return (
        isinstance(fn, _KEEPABLE)
        and isinstance(getattr(fn, "__self__", None), (types.ModuleType, type(None)))
        and "<" not in getattr(fn, "__qualname__", "<")  # not <lambda>, nor in <locals>
    )


def _placement(fn: Any) -> Placement:
    if getattr(fn, _MARK, False):
        return Placement.AWAITABLE
    if getattr(fn, _ON_LOOP, False):
        return Placement.INLINE
    if inspect.iscoroutinefunction(fn) or (
        not isinstance(fn, type)  # calling a class makes an instance, whatever its __call__
        and inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004
    ):
        return Placement.LOOP
    return Placement.THREAD


def function_name(fn: Any) -> str:
    """A readable ``module.qualname`` for error messages (or the ``rpc_name`` a callable
    object gives itself); kept with its placement for a function (a caller names every
    call)."""
    if type(fn) is types.FunctionType:
        return describe(fn)[1]
    return _name_of(fn)


def _name_of(fn: Any) -> str:
    own = getattr(fn, "rpc_name", None)
    if isinstance(own, str):
        return own
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}.{name}" if module else str(name)


def pack_error(exc: BaseException, worker: str, function: str) -> tuple[bytes, list[memoryview]]:
    """Serialise an exception raised while running ``function`` on ``worker``."""
    text = "".join(traceback.format_exception(exc))
    if isinstance(exc, Exception):
        try:
            packed = dumps((exc, worker, function, text))
            loads(*packed)  # it must also rebuild on the caller
            return packed
        except Exception:
            pass
    return dumps((_stand_in(exc), worker, function, text))


def unpack_error(packed: Any) -> BaseException:
    """Rebuild a remote exception from what :func:`pack_error` made (once unpickled),
    with where it came from attached."""
    raw, worker, function, text = packed
    if isinstance(raw, BaseException):  # (never a SystemExit of a peer's making here)
        exc = as_exception(raw)
    else:
        exc = RemoteError(f"malformed error: {raw!r}")
    exc.remote_worker = worker  # type: ignore[attr-defined]
    exc.remote_function = function  # type: ignore[attr-defined]
    exc.remote_traceback = text  # type: ignore[attr-defined]
    exc.add_note(f"\n--- raised on worker {worker!r} in {function} ---\n{text.rstrip()}")
    return exc


def as_exception(exc: BaseException) -> Exception:
    """``exc`` itself, or for a ``KeyboardInterrupt``/``SystemExit`` raised by remote
    code, a :class:`RemoteError` naming it: it must end a call, never a worker."""
    return exc if isinstance(exc, Exception) else _stand_in(exc)


def _stand_in(exc: BaseException) -> RemoteError:
    """What travels for an exception that cannot, or must not, be re-raised as itself."""
    return RemoteError(f"{type(exc).__qualname__}: {exc}", exc_type=_type_name(exc))


def _type_name(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"
