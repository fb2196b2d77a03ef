"""The job dashboard in a real browser: headless Chromium, driven over the DevTools
protocol (a websocket, with aiohttp), watches a real 3-worker job on loopback
(tests/dashboard_scenarios.py).  The page must show the three workers, count the calls
the job makes, and show a SIGKILLed worker as lost.

With ``ASYNCRPC_SAVE_SCREENSHOT=1`` it also saves the page to docs/dashboard.png (the
README's picture).  Skipped where no Chromium is installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest

from tests.cluster import ROOT, free_port
from tests.dashboard_scenarios import CALLED_PREFIX, URL_PREFIX

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER = next((path for name in BROWSERS if (path := shutil.which(name))), None)
SIZE = (1000, 700)
SCREENSHOT = ROOT / "docs" / "dashboard.png"
WORLD = 3
WORK = "tests.dashboard_scenarios.work"
NONE = "\u2013"  # what the page shows for a figure it does not have


# -- the job -------------------------------------------------------------------------


class Job:
    """The 3 worker processes; w0's stdin takes commands, its stdout says back."""

    def __init__(self, procs: list[asyncio.subprocess.Process], logs: Sequence[IO[bytes]]) -> None:
        self.procs = procs
        self.logs = logs

    @property
    def w0(self) -> asyncio.subprocess.Process:
        return self.procs[0]

    async def expect(self, prefix: str, timeout: float) -> str:
        """The rest of w0's next stdout line that starts with ``prefix``."""
        assert self.w0.stdout is not None
        async with asyncio.timeout(timeout):
            while line := (await self.w0.stdout.readline()).decode():
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
        raise AssertionError(f"w0 ended without saying {prefix!r}:\n{self.describe()}")

    async def command(self, line: str) -> None:
        assert self.w0.stdin is not None
        self.w0.stdin.write(f"{line}\n".encode())
        await self.w0.stdin.drain()

    def describe(self) -> str:
        """What each worker wrote on stderr (and w1, w2 on stdout), for a failure."""
        out = []
        for rank, log in enumerate(self.logs):
            log.seek(0)
            out.append(f"--- w{rank} ({self.procs[rank].returncode}):\n{log.read().decode()}")
        return "\n".join(out)

    async def stop(self, timeout: float) -> None:
        """Ask w0 to leave, wait (bounded) for every worker, and kill what is left."""
        with contextlib.suppress(OSError, RuntimeError):
            await self.command("stop")
        if self.w0.stdin is not None:
            self.w0.stdin.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(p.wait() for p in self.procs))
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def watched_job() -> AsyncIterator[Job]:
    """Start tests.dashboard_scenarios.watched on 3 processes; stop it on the way out."""
    port = free_port()
    procs: list[asyncio.subprocess.Process] = []
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(tempfile.TemporaryFile()) for _ in range(WORLD)]
        try:
            for rank in range(WORLD):
                procs.append(await _spawn(rank, port, logs[rank]))
            yield Job(procs, logs)
        finally:
            await Job(procs, logs).stop(timeout=15)


async def _spawn(rank: int, port: int, log: IO[bytes]) -> asyncio.subprocess.Process:
    """One worker; w0's stdin and stdout are pipes, the rest goes to ``log``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    pipe = asyncio.subprocess.PIPE
    args = ["dashboard_scenarios.watched", str(rank), str(WORLD), str(port), "uvloop", "unix"]
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *["-m", "tests.worker", *args],
        cwd=ROOT,
        env=env,
        stdin=pipe if rank == 0 else asyncio.subprocess.DEVNULL,
        stdout=pipe if rank == 0 else log,
        stderr=log,
    )


# -- the browser ---------------------------------------------------------------------


class Page:
    """One page of the browser, over the DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def send(self, method: str, timeout: float = 10.0, **params: Any) -> dict[str, Any]:
        """Send a command and await its answer (events on the way are passed over)."""
        message_id = next(self.ids)
        await self.ws.send_json({"id": message_id, "method": method, "params": params})
        async with asyncio.timeout(timeout):
            async for message in self.ws:
                answer = json.loads(message.data)
                if answer.get("id") != message_id:
                    continue
                if "error" in answer:
                    raise AssertionError(f"{method}: {answer['error']}")
                return dict(answer["result"])
        raise AssertionError(f"the browser closed its connection during {method}")

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-like)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")


async def _devtools_port(profile: Path, browser: asyncio.subprocess.Process, log: IO[bytes]) -> int:
    """The port Chromium chose; it writes it to DevToolsActivePort in its profile."""
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and browser.returncode is None:
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            return int(active.read_text().splitlines()[0])
        await asyncio.sleep(0.05)
    log.seek(0)
    said = log.read().decode(errors="replace")[-3000:]
    raise AssertionError(f"{BROWSER} (exit {browser.returncode}) gave no DevTools port:\n{said}")


@contextlib.asynccontextmanager
async def headless_page() -> AsyncIterator[Page]:
    """A headless Chromium with one blank page; it and its children are killed on the
    way out (it runs in a process group of its own)."""
    assert BROWSER is not None
    with (
        tempfile.TemporaryDirectory(prefix="asyncrpc-chromium-") as profile,
        tempfile.TemporaryFile() as log,
    ):
        browser = await asyncio.create_subprocess_exec(
            BROWSER, "--headless=new", "--remote-debugging-port=0",
            f"--user-data-dir={profile}", f"--window-size={SIZE[0]},{SIZE[1]}",
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions",
            "--disable-background-networking", "--disable-component-update",
            "--hide-scrollbars", "about:blank",
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        try:
            port = await _devtools_port(Path(profile), browser, log)
            async with _first_page(port) as page:
                yield page
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(browser.pid, signal.SIGKILL)
            await browser.wait()


@contextlib.asynccontextmanager
async def _first_page(port: int) -> AsyncIterator[Page]:
    """The browser's page, over its DevTools websocket."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            yield Page(ws)


# -- reading the page ----------------------------------------------------------------

SNAPSHOT = """(() => {
  if (!document.body || !document.getElementById("total-calls")) return null;
  const text = (id) => document.getElementById(id).textContent;
  const field = (tr, f) => tr.querySelector(`[data-field="${f}"]`).textContent;
  return {
    polls: Number(document.body.dataset.polls || 0),
    total: text("total-calls"), rate: text("call-rate"), errors: text("total-errors"),
    alive: text("workers-alive"),
    workers: [...document.querySelectorAll("#workers tbody tr")].map((tr) => ({
      name: tr.dataset.worker, alive: tr.dataset.alive, host: field(tr, "host"),
      status: field(tr, "status"), calls: field(tr, "calls"),
      owner_rrefs: field(tr, "owner_rrefs"),
    })),
    functions: [...document.querySelectorAll("#functions tbody tr")].map((tr) => ({
      worker: tr.dataset.worker, function: tr.dataset.function, side: tr.dataset.side,
      calls: field(tr, "calls"), p50: field(tr, "p50_ms"),
    })),
    chart: document.querySelectorAll("#rate-chart polyline").length,
  };
})()"""


async def snapshot(page: Page) -> dict[str, Any] | None:
    """What the page shows (None while it loads)."""
    seen = await page.evaluate(SNAPSHOT)
    return None if seen is None else dict(seen)


async def wait_for(
    page: Page, what: str, check: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    """Poll the page until ``check(snapshot)`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    seen: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        seen = await snapshot(page)
        if seen is not None and check(seen):
            return seen
        await asyncio.sleep(0.1)
    raise AssertionError(f"the page did not show {what} in {timeout} s; it showed:\n{seen}")


def _function(seen: dict[str, Any], worker: str, side: str) -> dict[str, Any] | None:
    rows = (f for f in seen["functions"] if (f["worker"], f["function"]) == (worker, WORK))
    return next((f for f in rows if f["side"] == side), None)


# -- the test ------------------------------------------------------------------------


@pytest.mark.skipif(BROWSER is None, reason="no chromium binary (apt-get install chromium)")
async def test_the_dashboard_shows_the_job_its_calls_and_a_lost_worker() -> None:
    async with watched_job() as job, headless_page() as page:
        url = await job.expect(URL_PREFIX, timeout=30)
        width, height = SIZE
        await page.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                        deviceScaleFactor=1, mobile=False)  # fmt: skip
        await page.send("Page.navigate", url=url)
        await _shows_three_live_workers(page)
        await _counts_the_calls(job, page, rounds=40)
        await _shows_a_killed_worker_lost(job, page)
        if os.environ.get("ASYNCRPC_SAVE_SCREENSHOT") == "1":
            await _save_screenshot(job, page)


async def _shows_three_live_workers(page: Page) -> None:
    seen = await wait_for(page, "3 workers", lambda s: len(s["workers"]) == WORLD, timeout=15)
    assert [(w["name"], w["alive"]) for w in seen["workers"]] == [
        ("w0", "true"),
        ("w1", "true"),
        ("w2", "true"),
    ]
    assert all(w["status"] == "alive" and w["host"] not in ("", NONE) for w in seen["workers"])
    assert seen["alive"] == "3"


async def _counts_the_calls(job: Job, page: Page, rounds: int) -> None:
    """The job makes ``rounds`` calls to each of w1 and w2 and one that fails: the total
    grows by at least 4 a round (made by w0, served by the peer), and the per-function
    rows say so, with a latency."""
    before = int((await wait_for(page, "a total", lambda s: True, timeout=5))["total"])
    await job.command(f"calls {rounds} 0 w1,w2")
    assert await job.expect(CALLED_PREFIX, timeout=30) == str(rounds)

    def counted(s: dict[str, Any]) -> bool:
        served = _function(s, "w1", "served")
        return (
            int(s["total"]) >= before + 4 * rounds + 1
            and served is not None
            and (int(served["calls"]) == rounds)
        )

    seen = await wait_for(page, f"{rounds} more rounds of calls", counted, timeout=10)
    made = _function(seen, "w0", "made")
    assert made is not None and int(made["calls"]) == 2 * rounds
    served = _function(seen, "w1", "served")
    assert served is not None and float(served["p50"]) > 0
    assert int(seen["errors"]) >= 1  # the call that failed (made by w0, served by w1)
    assert float(seen["rate"]) >= 0  # a number (calls a second since the previous poll)
    await wait_for(page, "the rate chart", lambda s: s["chart"] == 1, timeout=5)


async def _shows_a_killed_worker_lost(job: Job, page: Page) -> None:
    started = time.monotonic()
    job.procs[2].send_signal(signal.SIGKILL)

    def lost(s: dict[str, Any]) -> bool:
        return [w["alive"] for w in s["workers"]] == ["true", "true", "false"]

    seen = await wait_for(page, "w2 lost", lost, timeout=10)
    assert seen["workers"][2]["status"].startswith("lost") and seen["alive"] == "2"
    assert time.monotonic() - started < 10


async def _save_screenshot(job: Job, page: Page) -> None:
    """Some steady traffic for the chart, then the page as docs/dashboard.png."""
    before = (await wait_for(page, "polls", lambda s: True, timeout=5))["polls"]
    await job.command("calls 150 0.05 w1")
    await job.expect(CALLED_PREFIX, timeout=60)
    await wait_for(page, "a fresh poll", lambda s: s["polls"] > before + 2, timeout=10)
    shot = await page.send("Page.captureScreenshot", format="png")
    SCREENSHOT.write_bytes(base64.b64decode(shot["data"]))
