"""torch.distributed.rpc.functions: ``async_execution``.

asyncrpc's decorator: the function runs on the callee's event loop thread and
returns a ``torch.futures.Future`` (or an asyncio awaitable); the reply leaves when
it completes.  Unlike torch, where it runs in the callee's thread pool, it must not
block: non-blocking compat calls (``rpc_async``, ``Future.then``) work there, and
blocking ones (``rpc_sync``, ``Future.wait()`` on a pending future) raise.
"""

from asyncrpc.functions import async_execution

__all__ = ("async_execution",)
