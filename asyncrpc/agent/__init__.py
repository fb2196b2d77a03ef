"""The per-worker RPC agent: peers, pending calls, deadlines, dispatch, shutdown."""

from asyncrpc.agent.agent import (
    DEFAULT_BUSY_POLL,
    AgentOptions,
    RpcAgent,
    current_agent,
    set_default_agent,
)
from asyncrpc.agent.dispatch import async_execution
from asyncrpc.agent.worker import WorkerAddress, WorkerInfo, validate_name

__all__ = (
    "DEFAULT_BUSY_POLL",
    "AgentOptions",
    "RpcAgent",
    "WorkerAddress",
    "WorkerInfo",
    "async_execution",
    "current_agent",
    "set_default_agent",
    "validate_name",
)
