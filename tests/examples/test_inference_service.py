"""examples/inference_service.py for real: its aiohttp app served in this process (the
``frontend``, an asyncrpc worker), real model worker processes, a real aiohttp client.

Every answer is checked against the same MLP computed here.  Each service is started
with the example's own command-line flags (``make_parser().parse_args``), so what a
test configures -- one model worker, a queue of 1, a slow model -- is what a user can.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import torch

from tests.cluster import ROOT
from tests.examples.runner import run_example

sys.path.insert(0, str(ROOT / "examples"))
import inference_service as service  # by this name, as its model workers do

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

F = service.FEATURES
DEPTH = 8  # a shallower MLP than the example's: the same code, less CPU on a small machine
MODEL = service.build_model(DEPTH)
TIMEOUT = aiohttp.ClientTimeout(total=30)


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, F, generator=torch.Generator().manual_seed(seed))


def expected(x: torch.Tensor) -> torch.Tensor:
    """The MLP's outputs for ``x``, computed here."""
    with torch.no_grad():
        out: torch.Tensor = MODEL(x)
    return out


def assert_outputs(got: Any, x: torch.Tensor, tolerance: float = 1e-4) -> None:
    """``got`` (a nested list or a tensor) is the MLP's output for ``x`` (float32 rows:
    a batch's size may change the last bits of a row's result)."""
    want = expected(x)
    got = torch.as_tensor(got, dtype=torch.float32).reshape(want.shape)
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@contextlib.asynccontextmanager
async def serving(flags: list[str]) -> AsyncIterator[service.Service]:
    """The service, started in this process with ``--depth DEPTH`` and these flags."""
    args = service.make_parser().parse_args(["--depth", str(DEPTH), *flags])
    async with service.run_service(args) as running:
        yield running


@pytest_asyncio.fixture
async def started(request: pytest.FixtureRequest) -> AsyncIterator[service.Service]:
    """A service started with the example's defaults (but ``--depth DEPTH``), or with
    the flags a test passes (``parametrize("started", [[flags...]], indirect=True)``)."""
    async with serving(getattr(request, "param", [])) as running:
        yield running


@pytest_asyncio.fixture
async def client(started: service.Service) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(started.url, timeout=TIMEOUT) as session:
        yield session


async def post_json(client: aiohttp.ClientSession, payload: Any) -> tuple[int, Any]:
    async with client.post("/predict", json=payload) as answer:
        return answer.status, await answer.json()


async def post_raw(
    client: aiohttp.ClientSession, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes, Any]:
    async with client.post("/predict", data=body, headers=headers) as answer:
        return answer.status, await answer.read(), answer.headers


async def health(client: aiohttp.ClientSession) -> tuple[int, dict[str, Any]]:
    async with client.get("/health") as answer:
        return answer.status, await answer.json()


def raw_headers(shape: str, dtype: str = "float32") -> dict[str, str]:
    return {"Content-Type": service.RAW, "X-Dtype": dtype, "X-Shape": shape}


BAD_INPUTS: dict[str, tuple[bytes, dict[str, str], str]] = {
    # name: (body, headers, a part of the message)
    "malformed JSON": (b'{"inputs": [[1.0,', {}, "not valid JSON"),
    "no inputs key": (b'{"rows": [[1.0]]}', {}, '"inputs"'),
    "a row is not a list": (b'{"inputs": [1.0, 2.0]}', {}, "list of rows"),
    "a value is not a number": (json.dumps({"input": ["x"] * F}).encode(), {}, "number"),
    "too few features": (json.dumps({"inputs": [[0.5] * (F - 1)]}).encode(), {}, f"{F} features"),
    "no rows": (b'{"inputs": []}', {}, "1 to"),
    "not finite": (json.dumps({"input": [math.nan] * F}).encode(), {}, "finite"),
    "unknown dtype": (bytes(8 * F), raw_headers(f"1,{F}", "int64"), "X-Dtype"),
    "no dtype": (bytes(4 * F), {"Content-Type": service.RAW, "X-Shape": str(F)}, "X-Dtype"),
    "shape not numbers": (bytes(4 * F), raw_headers(f"one,{F}"), "X-Shape"),
    "wrong feature count (raw)": (bytes(4 * 15 * 2), raw_headers("2,15"), "X-Shape"),
    "3-D shape": (bytes(4 * F), raw_headers(f"1,1,{F}"), "X-Shape"),
    "bytes do not match the shape": (bytes(4 * F * 3), raw_headers(f"4,{F}"), "bytes"),
}


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client of one service with the example's defaults, for a whole test class."""
    async with (
        serving([]) as running,
        aiohttp.ClientSession(running.url, timeout=TIMEOUT) as client,
    ):
        yield client


class TestAHealthyService:
    """One service of two model workers, shared by the tests that leave it as it was."""

    pytestmark = pytest.mark.asyncio(loop_scope="class")

    async def test_json_rows_get_the_mlp_outputs(self, session: aiohttp.ClientSession) -> None:
        x = rows(5)
        status, body = await post_json(session, {"inputs": x.tolist()})
        assert status == 200, body
        assert_outputs(body["outputs"], x)
        status, body = await post_json(session, {"input": x[0].tolist()})
        assert status == 200, body
        assert_outputs(body["output"], x[:1])

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
    async def test_raw_bytes_get_raw_outputs_of_the_same_dtype(
        self, session: aiohttp.ClientSession, dtype: torch.dtype
    ) -> None:
        x = rows(7, seed=1).to(dtype)
        name = str(dtype).removeprefix("torch.")
        status, body, headers = await post_raw(
            session, x.numpy().tobytes(), raw_headers(f"7,{F}", name)
        )
        assert status == 200, body
        assert headers["Content-Type"] == service.RAW
        assert (headers["X-Dtype"], headers["X-Shape"]) == (name, f"7,{service.CLASSES}")
        got = torch.frombuffer(bytearray(body), dtype=dtype).reshape(7, service.CLASSES)
        assert_outputs(got.float(), x.float(), 1e-4 if dtype != torch.float16 else 1e-2)

    async def test_a_single_raw_row_gets_a_single_output(
        self, session: aiohttp.ClientSession
    ) -> None:
        x = rows(1, seed=2)[0]
        status, body, headers = await post_raw(session, x.numpy().tobytes(), raw_headers(str(F)))
        assert status == 200, body
        assert headers["X-Shape"] == str(service.CLASSES)
        got = torch.frombuffer(bytearray(body), dtype=torch.float32)
        assert_outputs(got, x[None])

    async def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(
        self, session: aiohttp.ClientSession
    ) -> None:
        inputs = [rows(1 + i % 3, seed=10 + i) for i in range(40)]
        answers = await asyncio.gather(
            *(post_json(session, {"inputs": x.tolist()}) for x in inputs)
        )
        for x, (status, body) in zip(inputs, answers, strict=True):
            assert status == 200, body
            assert_outputs(body["outputs"], x)
        _, report = await health(session)
        workers = report["workers"].values()
        assert sum(w["rows"] for w in workers) > sum(w["passes"] for w in workers)  # batched

    @pytest.mark.parametrize("case", BAD_INPUTS)
    async def test_bad_input_is_400_with_a_message(
        self, session: aiohttp.ClientSession, case: str
    ) -> None:
        body, headers, says = BAD_INPUTS[case]
        headers = headers or {"Content-Type": "application/json"}
        async with session.post("/predict", data=body, headers=headers) as answer:
            assert answer.status == 400, await answer.text()
            assert says in (await answer.json())["error"]

    async def test_an_unknown_content_type_is_415(self, session: aiohttp.ClientSession) -> None:
        async with session.post(
            "/predict", data=b"1,2,3", headers={"Content-Type": "text/csv"}
        ) as answer:
            assert answer.status == 415
            assert "Content-Type" in (await answer.json())["error"]

    async def test_health_reports_every_worker_live(self, session: aiohttp.ClientSession) -> None:
        status, report = await health(session)
        assert status == 200 and report["live"] == 2, report
        assert set(report["workers"]) == {"model0", "model1"}
        for worker in report["workers"].values():
            assert worker["live"] is True and worker["outstanding"] == 0, worker


@pytest.mark.parametrize(
    "started", [["--models", "1", "--max-queue", "1", "--model-delay", "1.0"]], indirect=True
)
async def test_a_full_batch_queue_is_429(client: aiohttp.ClientSession) -> None:
    # One slow worker: while its first batch runs (1 s), one row may wait; the rest are
    # refused at once.
    inputs = [rows(1, seed=20 + i) for i in range(6)]

    async def ask(x: torch.Tensor) -> tuple[int, Any, Any]:
        async with client.post("/predict", json={"inputs": x.tolist()}) as answer:
            return answer.status, await answer.json(), answer.headers

    answers = await asyncio.gather(*(ask(x) for x in inputs))
    statuses = sorted(status for status, _, _ in answers)
    assert set(statuses) == {200, 429}, answers
    assert statuses.count(200) >= 1 and statuses.count(429) >= 3, statuses
    for x, (status, body, headers) in zip(inputs, answers, strict=True):
        if status == 200:
            assert_outputs(body["outputs"], x)
        else:
            assert "overloaded" in body["error"] and headers["Retry-After"] == "1"


async def test_requests_keep_succeeding_when_a_model_worker_is_killed_mid_run(
    started: service.Service, client: aiohttp.ClientSession
) -> None:
    outcomes: list[bool] = []  # True: a right answer
    enough_before, enough_after = asyncio.Event(), asyncio.Event()
    killed_at: list[int] = []

    async def one_client(seed: int) -> None:
        for i in range(1000):
            if enough_after.is_set():
                return
            x = rows(1 + i % 2, seed=1000 * seed + i)
            status, body = await post_json(client, {"inputs": x.tolist()})
            right = status == 200 and torch.allclose(
                torch.tensor(body["outputs"]), expected(x), rtol=1e-4, atol=1e-4
            )
            outcomes.append(right)
            if len(outcomes) >= 30:
                enough_before.set()
            if killed_at and len(outcomes) >= killed_at[0] + 60:
                enough_after.set()

    async with asyncio.timeout(40):
        clients = asyncio.gather(*(one_client(seed) for seed in range(8)))
        await enough_before.wait()
        while started.frontend.replicas.outstanding["model0"] == 0:
            await asyncio.sleep(0)  # until a call is in flight on model0 (the clients go on)
        started.workers.kill("model0")  # SIGKILL, mid-run
        killed_at.append(len(outcomes))
        await clients
    assert all(outcomes), f"{outcomes.count(False)} of {len(outcomes)} requests failed"
    assert len(outcomes) >= killed_at[0] + 60
    status, report = await health(client)
    assert status == 200 and report["live"] == 1, report
    assert report["workers"]["model0"]["live"] is False
    assert "model0" in report["workers"]["model0"]["error"]
    assert report["workers"]["model1"]["live"] is True


async def test_with_every_model_worker_killed_predict_is_503_at_once(
    started: service.Service, client: aiohttp.ClientSession
) -> None:
    x = rows(2)
    status, _ = await post_json(client, {"inputs": x.tolist()})
    assert status == 200  # connected to a worker; now every one dies
    for name in started.workers.names:
        started.workers.kill(name)
    for _ in range(3):
        began = time.monotonic()
        status, body = await post_json(client, {"inputs": x.tolist()})
        assert status == 503, body
        assert "no live model worker" in body["error"]
        assert time.monotonic() - began < 2.0
    status, report = await health(client)
    assert status == 503 and report["live"] == 0, report
    assert not any(w["live"] for w in report["workers"].values())


def test_the_script_smoke_run_succeeds_and_reports() -> None:
    results = run_example("inference_service", "--smoke", timeout=80)
    assert results["requests_ok"] == 60 and results["requests_failed"] == 0, results
    assert results["max_abs_error"] < 1e-4, results
    assert results["mean_batch_size"] >= 1.0 and results["requests_per_s"] > 0, results
