"""The job the dashboard's browser test watches (tests/integration/test_dashboard_browser.py).

Run as ``python -m tests.worker dashboard_scenarios.watched RANK 3 PORT uvloop unix``.
Every worker serves its metrics on a free port; w0 also serves the dashboard, prints
``DASHBOARD-URL <url>`` and then obeys one command a line on its stdin:

* ``calls N PAUSE PEERS``: N rounds of one call of :func:`work` to each of PEERS (names,
  comma-separated), PAUSE seconds apart, then one call of :func:`fail` to w1; prints
  ``CALLED N`` when done;
* ``stop`` (or the end of stdin): release w1 and w2 (:func:`release`) and leave the job.

The other workers serve until w0 releases them (at most ``SERVE_FOR`` seconds), then
leave too.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import torch

import asyncrpc
from tests.scenarios import Config

SERVE_FOR = 120.0
URL_PREFIX = "DASHBOARD-URL "
CALLED_PREFIX = "CALLED "


def work(x: torch.Tensor) -> torch.Tensor:
    """A small remote function with a tensor each way, so bytes move."""
    return x * 2


def fail() -> None:
    """A remote function that raises, so the page has an error to show."""
    raise ValueError("the dashboard test asked for an error")


_released = asyncio.Event()


async def release() -> None:
    """Called by w0 on w1 and w2 when the test is done: they may leave the job."""
    _released.set()


def make_value() -> torch.Tensor:
    """What w0 keeps an RRef to (owned by w1), so the page shows RRefs."""
    return torch.ones(4)


async def watched(cfg: Config) -> dict[str, Any]:
    """The job: w0 runs the dashboard and the commands, the others serve."""
    await cfg.join(metrics_port=0, rpc_timeout=10)
    if cfg.rank != 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_released.wait(), SERVE_FOR)
        await asyncrpc.shutdown(timeout=30)
        return {}
    print(URL_PREFIX + asyncrpc.get_debug_info()["dashboard_url"], flush=True)
    kept = asyncrpc.remote("w1", make_value)  # held until w0 leaves
    rounds = await _obey_stdin()
    del kept
    releases = [asyncrpc.rpc_async(peer, release) for peer in ("w1", "w2")]
    await asyncio.gather(*releases, return_exceptions=True)  # w2 may be gone
    await asyncrpc.shutdown(timeout=10)
    return {"rounds": rounds}


async def _obey_stdin() -> int:
    """Run the commands on stdin until ``stop`` or its end; the rounds of calls made."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    rounds = 0
    while line := (await reader.readline()).decode().split():
        if line[0] == "stop":
            break
        if line[0] == "calls":
            count, pause, peers = int(line[1]), float(line[2]), line[3].split(",")
            await _calls(count, pause, peers)
            rounds += count
            print(f"{CALLED_PREFIX}{count}", flush=True)
    return rounds


async def _calls(count: int, pause: float, peers: list[str]) -> None:
    """``count`` rounds of :func:`work` to each of ``peers``, then one failing call."""
    x = torch.arange(256, dtype=torch.float32)
    for _ in range(count):
        await asyncio.gather(
            *(asyncrpc.rpc_async(peer, work, args=(x,)) for peer in peers),
            return_exceptions=True,
        )
        if pause:
            await asyncio.sleep(pause)
    await asyncio.gather(asyncrpc.rpc_async("w1", fail), return_exceptions=True)
