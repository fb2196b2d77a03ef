"""Decorators for functions served over RPC (``asyncrpc.functions.async_execution``)."""

from asyncrpc.agent.dispatch import async_execution

__all__ = ("async_execution",)
