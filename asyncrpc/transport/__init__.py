"""Connections: authenticated, framed links over tcp and unix sockets; same-host shared memory."""

from asyncrpc.transport.admission import Admission
from asyncrpc.transport.endpoints import SCHEMES, dial, host_of, listen
from asyncrpc.transport.link import Link, LinkHandler, too_large
from asyncrpc.transport.liveness import DEFAULT_SILENT_PEER_TIMEOUT
from asyncrpc.transport.locality import KERNEL, MEMORY, NETWORK, Host, Scope, local_host
from asyncrpc.transport.shm import (
    DEFAULT_BUDGET,
    DEFAULT_MAX_IDLE,
    SHM_THRESHOLD,
    SegmentMapper,
    SegmentPool,
)
from asyncrpc.transport.stripes import DEFAULT_STRIPES, MAX_STRIPES, StripeListener

__all__ = (
    "DEFAULT_BUDGET",
    "DEFAULT_MAX_IDLE",
    "DEFAULT_SILENT_PEER_TIMEOUT",
    "DEFAULT_STRIPES",
    "KERNEL",
    "MAX_STRIPES",
    "MEMORY",
    "NETWORK",
    "SCHEMES",
    "SHM_THRESHOLD",
    "Admission",
    "Host",
    "Link",
    "LinkHandler",
    "SegmentMapper",
    "Scope",
    "SegmentPool",
    "StripeListener",
    "dial",
    "host_of",
    "listen",
    "local_host",
    "too_large",
)
