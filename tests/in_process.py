"""Several agents on one event loop, over real loopback sockets, for integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

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
