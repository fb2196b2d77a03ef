"""Serving many callers: batched functions and replicated workers.

``asyncrpc.functions.batch`` coalesces single-item calls into one call over a
list (see docs/batching.md); :class:`Replicas` spreads calls over workers that
serve the same functions.  This layer sits on the agent and knows nothing of
RRefs or autograd.
"""

from asyncrpc.serving.batch import BatchedFunction, batch
from asyncrpc.serving.queue import BatchQueue
from asyncrpc.serving.replicas import Replicas

__all__ = ("BatchQueue", "BatchedFunction", "Replicas", "batch")
