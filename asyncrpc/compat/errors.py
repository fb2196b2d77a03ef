"""Errors as torch.distributed.rpc raises them: asyncrpc's types, ``RuntimeError`` too.

torch raises ``RuntimeError`` for a timeout, a lost or unknown worker and a misused
RRef.  The compat layer raises the subclasses below, which are asyncrpc's own types
(``except asyncrpc.RPCTimeoutError`` still works) with ``RuntimeError`` among their
bases.  :func:`convert` turns a native error into its compat twin, keeping the
message, the details, the remote traceback attributes and notes, and the cause.
Remote exceptions of other types are re-raised as their own type, as torch does.
"""

from __future__ import annotations

import asyncrpc.errors as native

__all__ = (
    "ConfigurationError",
    "OperatorError",
    "PeerLostError",
    "RPCTimeoutError",
    "RRefError",
    "RemoteError",
    "SerializationError",
    "UnknownWorkerError",
    "convert",
)


class RPCTimeoutError(native.RPCTimeoutError, RuntimeError):
    """A call passed its deadline (torch: ``RuntimeError``)."""


class PeerLostError(native.PeerLostError, RuntimeError):
    """A worker was lost or could not be reached (torch: ``RuntimeError``)."""


class UnknownWorkerError(native.UnknownWorkerError, RuntimeError):
    """No worker of that name or rank (torch: ``RuntimeError``)."""


class RRefError(native.RRefError, RuntimeError):
    """An RRef used where it cannot be (torch: ``RuntimeError``)."""


class RemoteError(native.RemoteError, RuntimeError):
    """A remote exception that could not be rebuilt here (torch: ``RuntimeError``)."""


class SerializationError(native.SerializationError, RuntimeError):
    """A value that does not pickle, or a payload that does not unpickle."""


class ConfigurationError(ValueError, RuntimeError):
    """``init_rpc`` was given a bad name, rank or world size, or two workers share a name
    (asyncrpc: ``ValueError``; torch: ``RuntimeError``)."""


class OperatorError(TypeError, RuntimeError):
    """A torch operator called (by RPC) with arguments that match none of its schemas:
    Python's ``TypeError``, and torch's ``RuntimeError`` ("failed to match any schema")."""


_TWINS: dict[type[native.AsyncRPCError], type[native.AsyncRPCError]] = {
    native.RPCTimeoutError: RPCTimeoutError,
    native.PeerLostError: PeerLostError,
    native.UnknownWorkerError: UnknownWorkerError,
    native.RRefError: RRefError,
    native.RemoteError: RemoteError,
    native.SerializationError: SerializationError,
}


def convert(error: BaseException) -> BaseException:
    """``error`` as the compat layer raises it: a native error of a type with a twin
    above becomes that twin (same message, attributes, notes, cause and traceback);
    anything else is returned as it is."""
    twin = _TWINS.get(type(error)) if isinstance(error, native.AsyncRPCError) else None
    if twin is None:
        return error
    assert isinstance(error, native.AsyncRPCError)  # for the type checker
    converted = twin(_message(error), **error.details)
    converted.__dict__.update(error.__dict__)  # remote_worker, remote_traceback, __notes__
    converted.__cause__ = error.__cause__
    converted.__suppress_context__ = error.__suppress_context__
    return converted.with_traceback(error.__traceback__)


def _message(error: native.AsyncRPCError) -> str:
    """The message in torch's words where torch's tests or users look for them."""
    if isinstance(error, native.RemoteError) and error.details.get("exc_type"):
        return (
            "the remote exception could not be rebuilt here. Original exception on remote "
            f"side was {error}"
        )
    return str(error)
