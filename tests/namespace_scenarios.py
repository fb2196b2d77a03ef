"""Workers in network namespaces of their own (see tests/integration/test_namespaces.py).

The test runs ``python -m tests.worker namespace_scenarios.NAME ...`` inside ``ip netns
exec``; the rendezvous address and the address to listen on come from the environment.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import asyncrpc
from tests.netns import join_from_namespace
from tests.scenarios import Config, blake, echo, whoami

SIZES = (1 << 10, 1 << 20, 64 << 20, 400 << 20)  # bytes: inline, then shared-memory sized
SMALL = SIZES[0]  # below the shared-memory threshold (1 MiB): always on the socket


async def exchange(cfg: Config) -> dict[str, Any]:
    """A small call, then a tensor of each of ``SIZES`` to the peer (digested there) and
    back (echoed), both ranks at once, one size at a time (two 400 MB tensors alive
    here at most); the seconds each size took, the bytes each transport carried, what
    went through shared memory at most, and the links."""
    await join_from_namespace(cfg, transports=("unix", "tcp"), rpc_timeout=60)
    peer = f"w{1 - cfg.rank}"
    seen: dict[str, Any] = {"whoami": await asyncrpc.rpc_async(peer, whoami)}
    for nbytes in SIZES:
        started = time.monotonic()
        sent = torch.arange(nbytes // 4, dtype=torch.int32) * (cfg.rank + 3)
        digest = await asyncrpc.rpc_async(peer, blake, (sent,))
        back = await asyncrpc.rpc_async(peer, echo, (sent,))
        seen[str(nbytes)] = {"digest": digest == blake(sent), "echo": torch.equal(back, sent)}
        seen[f"{nbytes}_s"] = round(time.monotonic() - started, 3)
        del sent, back
    info = asyncrpc.get_debug_info()
    seen["links"] = info["links"]
    seen["bytes"] = info["bytes"]
    seen["shared_memory_peak"] = info["shared_memory"]["peak_bytes"]
    seen["pid"] = os.getpid()
    await asyncrpc.shutdown()
    return seen
