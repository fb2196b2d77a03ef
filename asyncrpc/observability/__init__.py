"""Seeing a running job: /metrics (Prometheus), /debug (JSON) and a live dashboard.

Opt-in with ``init_rpc(metrics_port=...)`` or ``ASYNCRPC_METRICS_PORT``; see
docs/observability.md.  The counters themselves live in the agent
(:mod:`asyncrpc.agent.metrics`) and are always on.
"""

from asyncrpc.observability.prometheus import exposition
from asyncrpc.observability.server import ObservabilityServer, job_reports, worker_report

__all__ = ("ObservabilityServer", "exposition", "job_reports", "worker_report")
