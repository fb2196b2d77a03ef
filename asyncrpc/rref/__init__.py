"""RRefs: remote references with owner-side reference counting.

``protocol`` is the pure state machine, ``context`` its asyncio shell (an agent
extension), ``handle`` the user-facing :class:`RRef` and :func:`remote`.
"""

from asyncrpc.rref.context import RRefContext, context_for
from asyncrpc.rref.handle import RRef, remote

__all__ = ("RRef", "RRefContext", "context_for", "remote")
