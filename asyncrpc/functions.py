"""Decorators for functions served over RPC: ``async_execution`` (as in
torch.distributed.rpc) and ``batch`` (many callers' items, one call over a list)."""

from asyncrpc.agent.dispatch import async_execution
from asyncrpc.serving import batch

__all__ = ("async_execution", "batch")
