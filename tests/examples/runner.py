"""Run an example script the way a user does and read its ``RESULT`` lines.

Every example ends with ``RESULT name=value`` lines; ``run_example`` runs
``python examples/NAME.py ARGS`` (which spawns its own workers on loopback), fails the
test with the whole output if the script fails or overruns, and returns the results
as floats.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
RESULT_PREFIX = "RESULT "


def run_example(name: str, *args: str, timeout: float = 150.0) -> dict[str, float]:
    """Run ``examples/{name}.py`` with ``args``; return its ``RESULT`` metrics."""
    return run_example_with_output(name, *args, timeout=timeout)[0]


def run_example_with_output(
    name: str, *args: str, timeout: float = 150.0
) -> tuple[dict[str, float], str]:
    """Run ``examples/{name}.py`` with ``args``; return its ``RESULT`` metrics and stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / f"{name}.py"), *args],
            check=False,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{name} overran {timeout}s:\n{exc.stdout}\n{exc.stderr}") from exc
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, f"{name} exited {done.returncode}\n{output}"
    results: dict[str, float] = {}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            key, _, value = line[len(RESULT_PREFIX) :].partition("=")
            results[key.strip()] = float(value)
    assert results, f"{name} printed no RESULT line\n{output}"
    return results, done.stdout
