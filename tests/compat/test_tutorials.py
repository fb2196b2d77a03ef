"""The RPC tutorials' programs in our seed documents run under asyncrpc.compat with only
their imports changed.

Each program in ``tests/compat/tutorials/`` is the code of a tutorial in
``shared/seeds/`` (the parameter server; DDP + RPC), and ``# compat-test:`` marks every
line changed for other reasons than imports (a synthetic MNIST, CPU for CUDA, fewer
epochs, free ports).  Each test runs one the way the tutorial says to (the parameter
server: one command per rank; DDP + RPC: ``python -m ...``, which spawns its workers), in
a subprocess with a bounded time, and checks that it exits 0 and trained: it printed every
iteration it should, and where it prints losses, that they fell.  Results and times:
docs/compat.md, "The seed tutorials".
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
TIMEOUT = 120.0  # seconds for one program, all its workers included

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * TIMEOUT)]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on localhost now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tutorial_env(ports: int) -> dict[str, str]:
    """The environment of a tutorial's processes: ``TUTORIAL_PORTS`` (read by the programs'
    ``stand_ins.port``), unbuffered output, and no rendezvous variables of ours."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["TUTORIAL_PORTS"] = ",".join(str(p) for p in free_ports(ports))
    return env


def start(name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", f"tests.compat.tutorials.{name}", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: its workers die with it
    )


def finish(name: str, processes: list[subprocess.Popen[str]]) -> list[str]:
    """Wait for ``processes`` (one deadline for all); their stdouts.  Fails with every
    output if one overruns or exits non-zero."""
    outputs: list[tuple[int | None, str, str]] = []
    overran = False
    for process in processes:
        try:
            out, err = process.communicate(timeout=TIMEOUT if not overran else 5.0)
        except subprocess.TimeoutExpired:
            overran = True
            os.killpg(process.pid, signal.SIGKILL)  # the program and the workers it spawned
            out, err = process.communicate()
        outputs.append((process.returncode, out, err))
    report = "\n".join(
        f"--- process {i} exited {rc}\nstdout:\n{out}\nstderr:\n{err}"
        for i, (rc, out, err) in enumerate(outputs)
    )
    assert not overran, f"{name} overran {TIMEOUT}s\n{report}"
    assert all(rc == 0 for rc, _, _ in outputs), f"{name} failed\n{report}"
    return [out for _, out, _ in outputs]


def run_tutorial(name: str, *args: str, ports: int = 1) -> str:
    """Run ``python -m tests.compat.tutorials.NAME ARGS`` (it spawns its own workers).

    The workers share the stdout pipe, and ``print`` writes its text and its newline in
    two writes: lines of two workers may interleave, so match their messages unanchored."""
    return finish(name, [start(name, list(args), tutorial_env(ports))])[0]


def test_parameter_server_learns_mnist_stand_in() -> None:
    """The parameter-server tutorial, as it says to run it: one command per rank (server
    and one trainer).  The trainer's loss falls and its accuracy beats chance (0.1).

    With two trainers or more the program fails under torch too (pytorch/tutorials#2095):
    one trainer's optimizer step modifies the shared weights in place between another's
    forward and backward; it fails the same way under compat."""
    env = tutorial_env(1)
    port = env["TUTORIAL_PORTS"]
    processes = [
        start(
            "parameter_server",
            ["--world_size=2", f"--rank={rank}", f"--master_port={port}"],
            env,
        )
        for rank in range(2)
    ]
    server, trainer = finish("parameter_server", processes)
    assert "RPC shutdown on parameter server." in server, server
    losses = [
        (int(m[1]), float(m[2]))
        for m in re.finditer(r"^Rank 1 training batch (\d+) loss ([\d.]+)$", trainer, re.M)
    ]
    assert [i for i, _ in losses] == [0, 5, 10, 15], trainer  # 640 images, batches of 32
    assert losses[-1][1] < losses[0][1], trainer
    accuracy = re.search(r"^Accuracy ([\d.]+)$", trainer, re.M)
    assert accuracy is not None, trainer
    assert float(accuracy[1]) > 0.5, trainer


def test_ddp_rpc_trains_both_trainers() -> None:
    """DDP + RPC: a RemoteModule EmbeddingBag on ``ps`` passed to two trainers by
    ``rpc_async``; a DDP Linear (gloo group of the trainers) inside distributed autograd
    contexts; ``DistributedOptimizer`` over remote and local parameters.  Both trainers
    finish every epoch (EPOCHS = 5 of 10 batches; targets are random, no loss printed)."""
    stdout = run_tutorial("ddp_rpc", ports=2)
    done = Counter(re.findall(r"Training done for epoch (\d+)", stdout))
    assert done == {str(e): 2 for e in range(5)}, stdout
