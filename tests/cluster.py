"""Run a real multi-process asyncrpc job for a test and collect what each worker saw.

Each worker is ``python -m tests.worker SCENARIO ...`` in its own process (no
fork: a fresh interpreter, like a real job).  A scenario is an ``async def
(rank, world) -> dict`` in ``tests/scenarios.py``; the dict it returns comes
back here as JSON.  Every wait is bounded: a job that overruns is killed and
the test fails with each worker's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrpc.rendezvous import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "SCENARIO-RESULT "


@dataclass
class Worker:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str

    @property
    def result(self) -> dict[str, Any]:
        for line in reversed(self.stdout.splitlines()):
            if line.startswith(RESULT_PREFIX):
                return dict(json.loads(line[len(RESULT_PREFIX) :]))
        raise AssertionError(f"worker {self.rank} reported no result:\n{self.describe()}")

    def describe(self) -> str:
        return (
            f"--- rank {self.rank} exit {self.returncode}\nstdout:\n{self.stdout}"
            f"\nstderr:\n{self.stderr}"
        )


def run_script(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` from the repository root (a benchmark, say), output captured;
    fails the test unless it exits 0."""
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def run_job(
    scenario: str,
    world: int = 2,
    *,
    loop: str = "uvloop",
    transport: str = "unix",
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    expect_exit: dict[int, int] | None = None,
) -> list[Worker]:
    """Run ``scenario`` on ``world`` worker processes; returns them after all exit."""
    port = free_port()
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.worker",
                scenario,
                str(rank),
                str(world),
                str(port),
                loop,
                transport,
            ],
            cwd=ROOT,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    workers = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            workers.append(Worker(rank, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        outputs = [Worker(r, p.wait(), *p.communicate()) for r, p in enumerate(procs)]
        raise AssertionError(
            f"job {scenario!r} did not finish in {timeout}s\n"
            + "\n".join(w.describe() for w in outputs)
        ) from None
    expected = expect_exit or {}
    for w in workers:
        if w.returncode != expected.get(w.rank, 0):
            raise AssertionError(
                f"job {scenario!r}: rank {w.rank} exited {w.returncode}\n"
                + "\n".join(x.describe() for x in workers)
            )
    return workers
