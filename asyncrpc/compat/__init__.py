"""asyncrpc.compat: torch.distributed.rpc's blocking API, names and semantics, on asyncrpc.

Change only the imports of a torch RPC program::

    import asyncrpc.compat.rpc as rpc                      # torch.distributed.rpc
    import asyncrpc.compat.autograd as dist_autograd       # torch.distributed.autograd
    from asyncrpc.compat.optim import DistributedOptimizer # torch.distributed.optim
    from asyncrpc.compat.nn import RemoteModule            # torch.distributed.nn

asyncrpc's event loop runs in a background thread (see
:mod:`asyncrpc.compat._runtime`); see docs/compat.md for the differences.
"""

from asyncrpc.compat import autograd, nn, optim, rpc

__all__ = ("autograd", "nn", "optim", "rpc")
