"""The frame codec's per-message cost: what a no-op RPC spends in asyncrpc.wire.codec.

No sockets, no loop: only the sans-IO codec, driven the way the transport drives it.

1. encode: ``encode_frame(Kind.REQUEST, {"i": call_id, "f": "noop"}, payload)`` per
   message, ``payload`` a small pickle of ``(noop, (), {})`` as a no-op call carries.
2. decode, one per read: each encoded frame written into ``FrameDecoder.get_buffer()``,
   then ``buffer_updated(n)`` and ``next_event()`` until ``NEED_DATA``, as
   ``Link.buffer_updated``/``Link._process_frames`` do (the copy stands in for the
   kernel's write into that buffer).
3. decode, a batch of 64 frames arriving in one read, the same way.

Each is timed over ``--messages`` messages, ``--repeats`` times; the best is reported in
ns per message.  Usage: ``python benchmarks/bench_codec.py [--messages N] [--repeats R]
[--json]``.  It says which codec it measured (``compiled`` is true when
asyncrpc.wire.codec is an extension module).  Small VMs are noisy: compare runs made
back to back, on the same machine.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

from asyncrpc.wire import codec
from asyncrpc.wire.codec import NEED_DATA, FrameDecoder, Limits, encode_frame
from asyncrpc.wire.messages import Kind

BATCH = 64


def noop() -> None:
    """The function a no-op call names (pickled by reference)."""


def request_payload() -> bytes:
    return pickle.dumps((noop, (), {}), protocol=5)


def encode_all(messages: int, payload: bytes) -> list[bytes]:
    frames = []
    for i in range(messages):
        (part,) = encode_frame(Kind.REQUEST, {"i": i, "f": "noop"}, payload)
        frames.append(bytes(part))
    return frames


def time_encode(messages: int, payload: bytes) -> float:
    request = Kind.REQUEST
    start = time.perf_counter()
    for i in range(messages):
        encode_frame(request, {"i": i, "f": "noop"}, payload)
    return time.perf_counter() - start


def new_decoder() -> FrameDecoder:
    return FrameDecoder(Limits.established(1 << 30))


def time_decode(reads: list[bytes], frames_per_read: int) -> float:
    """Feed each read as the transport does; check every frame arrived."""
    decoder = new_decoder()
    need_data = NEED_DATA
    got = 0
    start = time.perf_counter()
    for data in reads:
        n = len(data)
        decoder.get_buffer()[:n] = data
        decoder.buffer_updated(n)
        while (frame := decoder.next_event()) is not need_data:
            got += 1
    elapsed = time.perf_counter() - start
    if got != len(reads) * frames_per_read or frame is not need_data:
        raise AssertionError(f"decoded {got} frames of {len(reads) * frames_per_read}")
    return elapsed


def best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def run(messages: int, repeats: int) -> dict[str, Any]:
    payload = request_payload()
    frames = encode_all(messages, payload)
    batches = [b"".join(frames[i : i + BATCH]) for i in range(0, messages - BATCH + 1, BATCH)]
    # Sanity: a decoded frame is the one encoded.
    decoder = new_decoder()
    decoder.receive_data(frames[7])
    frame = decoder.next_event()
    assert not isinstance(frame, type(NEED_DATA))
    assert (frame.kind, frame.meta, frame.payload) == (Kind.REQUEST, {"i": 7, "f": "noop"}, payload)

    ns = 1e9
    encode = best(lambda: time_encode(messages, payload), repeats) / messages * ns
    single = best(lambda: time_decode(frames, 1), repeats) / messages * ns
    batch = best(lambda: time_decode(batches, BATCH), repeats) / (len(batches) * BATCH) * ns
    return {
        "codec": codec.__file__,
        "compiled": not codec.__file__.endswith(".py"),
        "python": sys.version.split()[0],
        "messages": messages,
        "repeats": repeats,
        "frame_bytes": len(frames[0]),
        "payload_bytes": len(payload),
        "encode_ns": round(encode),
        "decode_ns": round(single),
        f"decode_batch{BATCH}_ns": round(batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    results = run(args.messages, args.repeats)
    if args.json:
        print(json.dumps(results))
        return
    print(f"codec: {results['codec']} (compiled: {results['compiled']})")
    print(f"{results['frame_bytes']}-byte REQUEST frames, best of {args.repeats}:")
    for key in ("encode_ns", "decode_ns", f"decode_batch{BATCH}_ns"):
        print(f"  {key:20} {results[key]:6} ns/message")


if __name__ == "__main__":
    main()
