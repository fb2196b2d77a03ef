"""A worker's debug info in the Prometheus text format.

Theory of operation
-------------------
The agent counts (``CallMetrics``, byte counters, gauges read on demand) and
``get_debug_info()`` gathers them as plain data.  :func:`exposition` turns one
such snapshot into Prometheus metric families with ``prometheus_client``'s
metric-family classes and its text writer: the library owns the format
(escaping, histogram ``_bucket``/``_count``/``_sum``, cumulative ``le``
buckets), while nothing of it sits on the call path.  Every sample carries the
``worker`` label.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def exposition(info: dict[str, Any]) -> bytes:
    """``info`` (what ``get_debug_info()`` returns) as Prometheus text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(info))
    return generate_latest(registry)


class _Snapshot(Collector):
    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info

    def collect(self) -> Iterator[Metric]:
        worker = str(self.info.get("worker", "?"))
        yield from _calls(worker, self.info.get("calls", {}))
        yield from _bytes(worker, self.info.get("bytes", {}))
        yield from _gauges(worker, self.info)


def _calls(worker: str, calls: dict[str, Any]) -> Iterator[Metric]:
    bounds = calls.get("buckets", [])
    for side, what in (("made", "made by"), ("served", "served by")):
        counter = CounterMetricFamily(
            f"asyncrpc_calls_{side}",
            f"Calls {what} this worker that ended, per function and outcome",
            labels=["worker", "function", "outcome"],
        )
        for function, entry in sorted(calls.get(side, {}).items()):
            for outcome, count in sorted(entry["outcomes"].items()):
                counter.add_metric([worker, function, outcome], count)
        yield counter
    for side, key, name, doc in _HISTOGRAMS:
        yield _histogram(worker, bounds, calls.get(side, {}), key, (name, doc))


_HISTOGRAMS = (  # (side, key in its entries, metric name, help)
    ("made", "seconds", "call_seconds", "Seconds from rpc_async to the end of the call"),
    ("served", "seconds", "served_seconds", "Seconds from arrival to reply, queueing included"),
    ("served", "queued_seconds", "queued_seconds", "Seconds a served call waited to start"),
)


def _histogram(
    worker: str,
    bounds: list[float],
    per_function: dict[str, Any],
    key: str,
    named: tuple[str, str],
) -> Metric:
    family = HistogramMetricFamily(f"asyncrpc_{named[0]}", named[1], labels=["worker", "function"])
    for function, entry in sorted(per_function.items()):
        histogram = entry.get(key)
        if histogram is None:
            continue
        cumulative = list(accumulate(histogram["counts"]))
        buckets = [(repr(float(b)), c) for b, c in zip(bounds, cumulative, strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        family.add_metric([worker, function], buckets, histogram["sum"])
    return family


def _bytes(worker: str, per_transport: dict[str, dict[str, int]]) -> Iterator[Metric]:
    for direction in ("sent", "received"):
        counter = CounterMetricFamily(
            f"asyncrpc_bytes_{direction}",
            f"Bytes {direction} per transport (shared_memory: buffers passed in segments)",
            labels=["worker", "transport"],
        )
        for transport, counts in sorted(per_transport.items()):
            counter.add_metric([worker, transport], counts[direction])
        yield counter


_GAUGES = (  # (name, help, path into the debug info)
    ("calls_in_flight_outgoing", "Calls this worker made that have not ended",
     ("pending_outgoing_calls",)),
    ("calls_in_flight_incoming", "Calls this worker is serving", ("running_incoming_calls",)),
    ("pool_threads", "Threads of the worker's pool", ("thread_pool", "threads")),
    ("pool_threads_busy", "Pool threads running a job", ("thread_pool", "busy")),
    ("pool_jobs_queued", "Jobs waiting for a pool thread", ("thread_pool", "queued")),
    ("rrefs_owned", "RRefs whose value lives here and has users", ("owner_rrefs",)),
    ("rrefs_held", "RRefs held here whose value lives elsewhere", ("user_rrefs",)),
    ("autograd_contexts", "Distributed autograd contexts alive here", ("autograd_contexts",)),
    ("shared_memory_bytes_in_use", "Bytes of segments lent to peers",
     ("shared_memory", "bytes_in_use")),
    ("shared_memory_bytes_idle", "Bytes of idle pooled segments", ("shared_memory", "bytes_idle")),
    ("shared_memory_segments_in_use", "Segments lent to peers",
     ("shared_memory", "segments_in_use")),
    ("shared_memory_segments_idle", "Idle pooled segments", ("shared_memory", "segments_idle")),
    ("peers_connected", "Workers with an open link to or from this one", ("connected_peers",)),
    ("peers_dead", "Workers known to be lost", ("dead_peers",)),
)  # fmt: skip


def _gauges(worker: str, info: dict[str, Any]) -> Iterator[Metric]:
    for name, doc, path in _GAUGES:
        value = _lookup(info, path)
        if value is None:
            continue
        gauge = GaugeMetricFamily(f"asyncrpc_{name}", doc, labels=["worker"])
        gauge.add_metric([worker], len(value) if isinstance(value, list) else float(value))
        yield gauge


def _lookup(info: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = info
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value
