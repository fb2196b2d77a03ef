"""Several agents on one event loop, over real loopback sockets, for integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from asyncrpc.agent import AgentOptions, RpcAgent

SECRET = b"in-process test secret"


@asynccontextmanager
async def joined_agents(
    names: str, options: AgentOptions | Sequence[AgentOptions]
) -> AsyncIterator[list[RpcAgent]]:
    """One agent per letter of ``names`` (rank = position), started and joined; shut
    down (not gracefully) on exit.  ``options``: for all, or one per agent."""
    each = [options] * len(names) if isinstance(options, AgentOptions) else list(options)
    agents = [RpcAgent(name, rank, SECRET, each[rank]) for rank, name in enumerate(names)]
    addresses = [await agent.start() for agent in agents]
    for agent in agents:
        agent.join(addresses)
    try:
        yield agents
    finally:
        for agent in agents:
            await agent.shutdown(graceful=False)


@dataclass
class Sent:
    """The frames an agent sent a peer: their kinds and (copies of) their headers' meta."""

    kinds: list[int] = field(default_factory=list)
    metas: list[dict[str, Any]] = field(default_factory=list)


def watch_sends(agent: RpcAgent, peer: str) -> Sent:
    """Record every frame ``agent`` sends ``peer`` on its link from now on."""
    sent = Sent()
    link = agent._links[peer]
    send = link.send

    def recording(kind: int, meta: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        sent.kinds.append(kind)
        sent.metas.append(dict(meta))
        send(kind, meta, *args, **kwargs)

    link.send = recording  # type: ignore[method-assign]
    return sent
