"""The exception hierarchy: one root, builtin mix-ins where callers expect them.

Every exception here pickles (it may travel back to a caller on another worker):
constructors take the message first and everything else by keyword, and
``__reduce__`` rebuilds from exactly those.  This module imports nothing from
asyncrpc, so every layer may use it.
"""

from __future__ import annotations

from typing import Any


class AsyncRPCError(Exception):
    """Root of every error asyncrpc raises itself."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details
        for key, value in details.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), self.details))


def _rebuild(cls: type[AsyncRPCError], message: str, details: dict[str, Any]) -> AsyncRPCError:
    return cls(message, **details)


class ProtocolError(AsyncRPCError):
    """Bytes on a connection broke the wire protocol; the connection is dropped."""


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol forbids (e.g. an oversized frame)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids (garbage, oversized or unknown frames)."""


class HandshakeError(AsyncRPCError, ConnectionError):
    """The peer failed authentication or speaks another protocol version."""


class SerializationError(AsyncRPCError, TypeError):
    """A value could not be pickled, or a payload could not be unpickled."""


class RPCTimeoutError(AsyncRPCError, TimeoutError):
    """A call (or shutdown, or rendezvous) did not finish within its bound."""


class PeerLostError(AsyncRPCError, ConnectionError):
    """The connection to a worker was lost, or the worker could not be reached."""


class UnknownWorkerError(AsyncRPCError, ValueError):
    """No worker of that name or rank is part of the job."""


class AgentStateError(AsyncRPCError, RuntimeError):
    """The RPC agent is not running (not initialised yet, or shut down), or misused."""


class OverloadedError(AsyncRPCError, RuntimeError):
    """A service refused a call at once: its queue is full (see ``functions.batch``)."""


class RemoteError(AsyncRPCError):
    """A remote exception that could not be re-raised as its own type (it did not pickle).

    ``exc_type`` holds the remote type's qualified name.
    """


class RRefError(AsyncRPCError, LookupError):
    """An RRef was used where it cannot be: its value is gone, not ready, or not here."""
