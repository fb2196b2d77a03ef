"""Sans-IO wire protocol: frame codec, message kinds, handshake.  No asyncio, no sockets."""

from asyncrpc.wire.codec import (
    BATCHED_PAYLOAD_MAX,
    DEFAULT_MAX_FRAME_SIZE,
    HANDSHAKE_LIMITS,
    MAX_HANDSHAKE_FRAME,
    NEED_DATA,
    Allocator,
    ExternalRef,
    Frame,
    FrameDecoder,
    Limits,
    encode_batch,
    encode_entry,
    encode_frame,
    split_batch,
)
from asyncrpc.wire.handshake import Handshake, Identity, Role
from asyncrpc.wire.messages import HANDSHAKE_KINDS, PROTOCOL_VERSION, Kind

__all__ = (
    "BATCHED_PAYLOAD_MAX",
    "DEFAULT_MAX_FRAME_SIZE",
    "HANDSHAKE_KINDS",
    "HANDSHAKE_LIMITS",
    "MAX_HANDSHAKE_FRAME",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "Allocator",
    "ExternalRef",
    "Frame",
    "FrameDecoder",
    "Handshake",
    "Identity",
    "Kind",
    "Limits",
    "Role",
    "encode_batch",
    "encode_entry",
    "encode_frame",
    "split_batch",
)
