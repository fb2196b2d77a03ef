"""The per-worker RPC agent: peers, pending calls, deadlines, dispatch, shutdown."""

from asyncrpc.agent.agent import (
    DEFAULT_BUSY_POLL,
    AgentOptions,
    Extension,
    RpcAgent,
    current_agent,
    on_loop_thread,
    set_default_agent,
)
from asyncrpc.agent.dispatch import async_execution, on_loop
from asyncrpc.agent.notices import on_notice
from asyncrpc.agent.shutdown import Lifecycle
from asyncrpc.agent.transfer import Transfer, current_transfer, propagate, start_after
from asyncrpc.agent.worker import WorkerAddress, WorkerInfo, validate_name

__all__ = (
    "DEFAULT_BUSY_POLL",
    "AgentOptions",
    "Extension",
    "Lifecycle",
    "RpcAgent",
    "Transfer",
    "WorkerAddress",
    "WorkerInfo",
    "async_execution",
    "on_loop",
    "on_notice",
    "propagate",
    "current_agent",
    "on_loop_thread",
    "current_transfer",
    "start_after",
    "set_default_agent",
    "validate_name",
)
