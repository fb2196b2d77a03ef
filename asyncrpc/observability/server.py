"""The HTTP side of observability: /metrics, /debug and the job dashboard, on aiohttp.

Theory of operation
-------------------
With ``init_rpc(metrics_port=...)`` every worker runs a small aiohttp server on
its listen host (loopback for a loopback job, like its RPC listener), at
``metrics_port + rank`` so that workers sharing a host never collide (0: a free
port; ``get_debug_info()["metrics_url"]`` says which):

* ``GET /metrics``: this worker's figures in the Prometheus text format;
* ``GET /debug``: ``get_debug_info()`` as JSON.

Rank 0 also serves the dashboard: ``GET /`` is a page (and ``/static/...`` what
it loads; nothing from elsewhere) that polls ``GET /api/job`` about once a
second.  ``/api/job`` asks every worker for its :func:`worker_report` over
asyncrpc itself, all at once, each bounded by ``REPORT_TIMEOUT``; a worker that
does not answer is reported lost, with the reason.  A report is a summary (per
function: calls, errors, latency percentiles estimated from the histograms)
so the page only draws.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from importlib.resources import files
from typing import Any

from aiohttp import web

from asyncrpc.agent import RpcAgent, current_agent, on_loop
from asyncrpc.agent.metrics import quantile
from asyncrpc.observability.prometheus import CONTENT_TYPE, exposition

REPORT_TIMEOUT = 1.0  # seconds a worker has to answer the dashboard
REPORT_LABEL = "dashboard report"  # the name of the dashboard's own calls (as a function)
STATIC = files("asyncrpc.observability") / "static"


class ObservabilityServer:
    """One worker's HTTP endpoint (see the module docstring); an agent extension, so
    ``get_debug_info()`` says where it serves."""

    KEY = "observability"

    def __init__(self, agent: RpcAgent, host: str, port: int, *, dashboard: bool) -> None:
        self.agent = agent
        self.dashboard = dashboard
        self._host, self._port = host, port
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.error = ""  # why it does not serve, if it could not start

    def peer_lost(self, rank: int) -> None:
        """Nothing to do: the dashboard asks every worker afresh each time."""

    async def drain(self) -> None:
        """Nothing to do: it serves until the worker closes."""

    def close(self) -> None:
        """Nothing to do here: ``asyncrpc.shutdown`` awaits :meth:`stop`."""

    def debug_info(self) -> dict[str, Any]:
        where = {"metrics_url": f"{self.url}/metrics" if self.url else None}
        if self.dashboard and self.url:
            where["dashboard_url"] = f"{self.url}/"
        if self.error:
            where["metrics_error"] = self.error
        return where

    async def start(self) -> str:
        """Listen; the base URL."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/debug", self._debug)
        if self.dashboard:
            app.router.add_get("/", self._page)
            app.router.add_get("/static/{name}", self._static)
            app.router.add_get("/api/job", self._job)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        host = f"[{self._host}]" if ":" in self._host else self._host
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        """Stop serving (``asyncrpc.shutdown`` does)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        body = exposition(self.agent.debug_info())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _debug(self, request: web.Request) -> web.Response:
        return _json(self.agent.debug_info())

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(body=(STATIC / "dashboard.html").read_bytes(), content_type="text/html")

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        kinds = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
        kind = next((k for suffix, k in kinds.items() if name.endswith(suffix)), None)
        resource = STATIC / name
        if kind is None or "/" in name or not resource.is_file():
            raise web.HTTPNotFound(text=f"no static file {name!r}")
        return web.Response(body=resource.read_bytes(), content_type=kind)

    async def _job(self, request: web.Request) -> web.Response:
        return _json({"time": time.time(), "workers": await job_reports(self.agent)})


async def job_reports(agent: RpcAgent) -> list[dict[str, Any]]:
    """Every worker's report, asked over asyncrpc at once; a silent one is lost."""
    workers = agent.workers
    asked = [
        agent.rpc_async(w.name, worker_report, timeout=REPORT_TIMEOUT, label=REPORT_LABEL)
        for w in workers
    ]
    answers = await asyncio.gather(*asked, return_exceptions=True)
    reports = []
    for info, answer in zip(workers, answers, strict=True):
        if isinstance(answer, BaseException):
            reports.append({"name": info.name, "rank": info.id, "alive": False,
                            "error": f"{type(answer).__name__}: {answer}"})  # fmt: skip
        else:
            reports.append({**answer, "alive": True})
    return reports


@on_loop  # quick bookkeeping: read on the loop, where the figures change
def worker_report() -> dict[str, Any]:
    """This worker's summary for the dashboard (run on each worker over RPC)."""
    agent = current_agent()
    assert agent is not None
    info = agent.debug_info()
    calls = info.get("calls", {})
    return {
        "name": info["worker"],
        "rank": info["rank"],
        "host": socket.gethostname(),
        "state": info["state"],
        "functions": _function_summary(calls),
        "bytes": info.get("bytes", {}),
        "in_flight": _in_flight(agent, info),
        "owner_rrefs": info.get("owner_rrefs", 0),
        "user_rrefs": info.get("user_rrefs", 0),
        "autograd_contexts": info.get("autograd_contexts", 0),
        "dead_peers": info["dead_peers"],
    }


def _in_flight(agent: RpcAgent, info: dict[str, Any]) -> int:
    """Calls in flight, less the dashboard's own: this report (an incoming call) and,
    on the worker that serves the dashboard, the reports it still waits for."""
    asking = agent.pending_functions().count(REPORT_LABEL)
    running: int = info["pending_outgoing_calls"] + info["running_incoming_calls"]
    return max(0, running - 1 - asking)


def _function_summary(calls: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per function and side: calls ended, errors (not ok), p50 and p99 in ms."""
    out: dict[str, dict[str, Any]] = {}
    for side in ("made", "served"):
        for function, entry in calls.get(side, {}).items():
            outcomes = entry["outcomes"]
            total = sum(outcomes.values())
            out.setdefault(function, {})[side] = {
                "calls": total,
                "errors": total - outcomes.get("ok", 0),
                "p50_ms": _ms(quantile(entry["seconds"], 0.5)),
                "p99_ms": _ms(quantile(entry["seconds"], 0.99)),
            }
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _json(value: Any) -> web.Response:
    return web.Response(text=json.dumps(value, default=str), content_type="application/json")
