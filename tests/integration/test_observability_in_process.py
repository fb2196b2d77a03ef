"""/metrics, /debug and /api/job over a real aiohttp server and client, for agents on
one loop: the text parses as Prometheus, the numbers are the calls made, and a worker
that went away is reported lost."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncrpc.agent import AgentOptions, RpcAgent
from asyncrpc.observability import ObservabilityServer
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(30)


def add(x: int, y: int) -> int:
    return x + y


def fail() -> None:
    raise KeyError("no")


@pytest.fixture
async def served() -> AsyncIterator[tuple[list[RpcAgent], str]]:
    options = AgentOptions(transports=("unix",), rpc_timeout=10)
    async with joined_agents("abc", options) as agents:
        server = ObservabilityServer(agents[0], "127.0.0.1", 0, dashboard=True)
        agents[0].extension(ObservabilityServer.KEY, lambda _: server)
        url = await server.start()
        try:
            yield agents, url
        finally:
            await server.stop()


async def _get(url: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, response.headers["Content-Type"], await response.text()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_parse_as_prometheus_text_with_the_calls_made(
    served: tuple[list[RpcAgent], str],
) -> None:
    (a, _, _), url = served
    for i in range(3):
        await a.rpc_async("b", add, (i, i))
    with pytest.raises(KeyError):
        await a.rpc_async("b", fail)
    status, kind, text = await _get(f"{url}/metrics")
    assert status == 200 and kind.startswith("text/plain")
    samples = _samples(text)
    name = f"{add.__module__}.add"
    labels = (("function", name), ("outcome", "ok"), ("worker", "a"))
    assert samples[("asyncrpc_calls_made_total", labels)] == 3
    failed = (("function", f"{fail.__module__}.fail"), ("outcome", "error"), ("worker", "a"))
    assert samples[("asyncrpc_calls_made_total", failed)] == 1
    count = (("function", name), ("worker", "a"))
    assert samples[("asyncrpc_call_seconds_count", count)] == 3
    assert samples[("asyncrpc_call_seconds_bucket", (*count[:1], ("le", "+Inf"), count[1]))] == 3
    assert samples[("asyncrpc_bytes_sent_total", (("transport", "unix"), ("worker", "a")))] > 0
    assert samples[("asyncrpc_pool_threads", (("worker", "a"),))] >= 1


async def test_debug_is_the_debug_info_as_json(served: tuple[list[RpcAgent], str]) -> None:
    _, url = served
    status, kind, text = await _get(f"{url}/debug")
    assert status == 200 and kind.startswith("application/json")
    debug = json.loads(text)
    assert debug["worker"] == "a" and debug["metrics_url"] == f"{url}/metrics"
    assert debug["dashboard_url"] == f"{url}/"


async def test_the_job_api_reports_every_worker_and_a_lost_one(
    served: tuple[list[RpcAgent], str],
) -> None:
    (a, _, c), url = served
    await a.rpc_async("b", add, (1, 2))
    job = await _job(url)
    assert [(w["name"], w["alive"]) for w in job["workers"]] == [
        ("a", True),
        ("b", True),
        ("c", True),
    ]
    served_by_b = job["workers"][1]["functions"][f"{add.__module__}.add"]["served"]
    assert served_by_b["calls"] == 1 and served_by_b["errors"] == 0
    assert served_by_b["p50_ms"] > 0
    await c.shutdown(graceful=False)
    lost = (await _job(url))["workers"][2]
    assert lost["alive"] is False and "PeerLostError" in lost["error"]


async def _job(url: str) -> dict[str, Any]:
    status, _, text = await _get(f"{url}/api/job")
    assert status == 200
    return dict(json.loads(text))


async def test_the_page_and_its_script_are_served_and_nothing_else(
    served: tuple[list[RpcAgent], str],
) -> None:
    _, url = served
    status, kind, page = await _get(f"{url}/")
    assert status == 200 and kind.startswith("text/html") and "/static/dashboard.js" in page
    status, kind, _ = await _get(f"{url}/static/dashboard.js")
    assert status == 200 and kind.startswith("text/javascript")
    for missing in ("/static/nope.js", "/static/..%2F__init__.py", "/static/server.py"):
        assert (await _get(f"{url}{missing}"))[0] == 404
