"""Replicas: calls spread over workers that serve the same functions.

Theory of operation
-------------------
A :class:`Replicas` knows a set of workers and how many of its calls each has
outstanding.  A call goes to the live worker with the fewest outstanding
(ties: the one picked longest ago), so a slow or busy replica gets fewer.

A worker is marked lost when a call to it fails with
:class:`~asyncrpc.errors.PeerLostError`, or when the agent has lost contact with it
(any call, or a link lost, told it), and no call goes to it for
``retry_lost_after`` seconds; then the next call tries it again (a worker back
from a partition serves again; a dead one is marked lost again at once, since
a refused connection fails fast).  What happens to the failed call depends on
whether its request left:

* not sent (the agent could not connect): it goes to another live replica --
  a call that never left is never lost to a lost worker;
* sent, then the connection was lost: the worker may have run it, so it fails
  (at most once, as every RPC), unless the replicas were made
  ``idempotent=True``, in which case it too goes to another replica.

A replica whose ``@batch`` queue is full refuses a call at once
(:class:`~asyncrpc.errors.OverloadedError`, so it never ran): it goes to another
replica, and fails with the refusal only when every replica refused.  Each call
tries each replica at most once.  When no replica is live, a call fails at once
with ``PeerLostError`` (an HTTP front end answers 503).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from asyncrpc.agent import RpcAgent, WorkerInfo, current_agent
from asyncrpc.errors import AgentStateError, OverloadedError, PeerLostError


class Replicas:
    """Workers that serve the same functions, called least-outstanding-first.

    ``idempotent``: a call lost with its worker after it was sent is retried on another
    replica too.  ``retry_lost_after``: seconds a lost worker gets no calls.  ``agent``:
    the agent that calls (default: this worker's, from ``init_rpc``).
    """

    def __init__(
        self,
        workers: Sequence[str | WorkerInfo],
        *,
        idempotent: bool = False,
        retry_lost_after: float = 5.0,
        agent: RpcAgent | None = None,
    ) -> None:
        names = [w.name if isinstance(w, WorkerInfo) else w for w in workers]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"replicas need distinct worker names, got {names!r}")
        self.workers = tuple(names)
        self.idempotent = idempotent
        self.retry_lost_after = retry_lost_after
        self._agent = agent  # None: the worker's own (init_rpc's), found at call time
        self._outstanding = dict.fromkeys(names, 0)
        self._lost_at: dict[str, float] = {}  # worker -> loop time it was marked lost
        self._picked: dict[str, int] = dict.fromkeys(names, 0)  # worker -> pick serial
        self._serial = itertools.count(1)

    @property
    def live(self) -> list[str]:
        """The workers calls may go to now."""
        return self._others([])

    @property
    def outstanding(self) -> dict[str, int]:
        """Calls in flight per worker."""
        return dict(self._outstanding)

    def rpc_async(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> asyncio.Future[Any]:
        """Call ``func(*args, **kwargs)`` on one replica; a future of its result.

        ``timeout`` bounds each attempt (see ``asyncrpc.rpc_async``).  Raises
        ``PeerLostError`` when no replica is live, or when the call was lost with its
        worker after it was sent (and the replicas are not ``idempotent``).
        """
        agent = self._agent or current_agent()
        if agent is None:
            raise AgentStateError("Replicas.rpc_async needs a running agent: call init_rpc first")
        return asyncio.ensure_future(self._call(agent, func, args, kwargs, timeout))

    def mark_lost(self, worker: str) -> None:
        """Send no call to ``worker`` for ``retry_lost_after`` seconds."""
        self._lost_at[worker] = _now()

    async def _call(
        self,
        agent: RpcAgent,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float | None,
    ) -> Any:
        tried: list[str] = []
        while True:
            worker = self._choose(tried, func)
            tried.append(worker)
            self._outstanding[worker] += 1
            try:
                return await agent.rpc_async(worker, func, args, kwargs, timeout)
            except PeerLostError as exc:
                self.mark_lost(worker)
                if not (self.idempotent or exc.details.get("sent") is False):
                    raise
            except OverloadedError:
                if not self._others(tried):
                    raise
            finally:
                self._outstanding[worker] -= 1

    def _others(self, tried: list[str]) -> list[str]:
        """The live workers not in ``tried``."""
        now, agent_lost = _now(), self._agent_lost()
        return [w for w in self.workers if w not in tried and self._usable(w, now, agent_lost)]

    def _choose(self, tried: list[str], func: Callable[..., Any]) -> str:
        candidates = self._others(tried)
        if not candidates:
            raise PeerLostError(
                f"no live replica for {getattr(func, '__qualname__', func)!r}: "
                f"tried {tried}, lost {sorted(self._lost_at)} of {list(self.workers)}",
                workers=list(self.workers),
                tried=tried,
            )
        worker = min(candidates, key=lambda w: (self._outstanding[w], self._picked[w]))
        self._picked[worker] = next(self._serial)
        self._lost_at.pop(worker, None)  # tried again: live until it fails again
        return worker

    def _usable(self, worker: str, now: float, agent_lost: set[str]) -> bool:
        lost_at = self._lost_at.get(worker)
        if lost_at is None and worker in agent_lost:
            lost_at = self._lost_at[worker] = now  # news from the agent: lost from now
        return lost_at is None or now - lost_at >= self.retry_lost_after

    def _agent_lost(self) -> set[str]:
        agent = self._agent or current_agent()
        return agent.lost_peers if agent is not None else set()


def _now() -> float:
    return asyncio.get_running_loop().time()
