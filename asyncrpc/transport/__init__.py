"""Connections: authenticated, framed links over tcp and unix sockets; same-host shared memory."""

from asyncrpc.transport.admission import Admission
from asyncrpc.transport.endpoints import SCHEMES, dial, listen
from asyncrpc.transport.link import Link, LinkHandler, too_large
from asyncrpc.transport.shm import (
    DEFAULT_BUDGET,
    DEFAULT_MAX_IDLE,
    SHM_THRESHOLD,
    SegmentMapper,
    SegmentPool,
    host_identity,
)

__all__ = (
    "DEFAULT_BUDGET",
    "DEFAULT_MAX_IDLE",
    "SCHEMES",
    "SHM_THRESHOLD",
    "Admission",
    "Link",
    "LinkHandler",
    "SegmentMapper",
    "SegmentPool",
    "dial",
    "host_identity",
    "listen",
    "too_large",
)
