"""Soak test: three asyncrpc workers run mixed traffic for a while; nothing may go wrong.

What it does
------------
Starts three worker processes on loopback (``_soak_worker.py``, uvloop, one
intra-op thread each) that for ``--duration`` seconds call each other with a mix
of traffic: plain and ``async def`` no-op calls; tensor echoes from 256 B to 8 MiB
(below 1 MiB inline in the frame, from 1 MiB through shared memory), checked on
return; RRefs made with ``remote()``, used through method calls and ``to_here``,
forked to the third worker and dropped, and local RRefs fetched back by a peer;
distributed autograd steps (context, backward, ``get_gradients``, a
``DistributedOptimizer`` step) of a model split with the next worker; and calls
that fail on purpose (a remote ValueError, a 0.2 s timeout).  Then each worker
waits for its calls in flight and shuts down gracefully.

What it reports
---------------
Per worker: calls issued, completed and failed by exception type, with the
expected failures (the ValueErrors and timeouts asked for) told apart from
unexpected ones; RSS (``/proc/self/statm``) and the worst loop lag, sampled every
``--sample-every`` seconds; calls, RRefs and autograd contexts left at close; the
exit status.  A summary table at the end, every sample with ``--json PATH``.

It fails loudly (exit status 1, ``SOAK FAILED`` and the reasons) on a lost call
(issued != completed + failed once the traffic has drained), an unexpected
failure or wrong value, a worker that crashed, exited non-zero or overran, or
RRefs, contexts or calls left at close.  RSS growth is reported, not judged.

Usage: ``python benchmarks/soak.py [--duration S] [--sample-every S] [--json PATH]``
(default 60 s; ``make soak``).  The machine's cores are shared by the three
workers: expect them busy for the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrpc.rendezvous import free_port

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_soak_worker.py"
WORLD = 3
STARTUP_S = 60.0  # rendezvous and imports, on a busy machine
WIND_DOWN_S = 150.0  # draining the calls in flight (45 s at most) and shutting down (90)
AFTER_A_CRASH_S = 60.0  # how long the others may take to notice and report
LOG_TAIL = 25
EXPECTED_ERRORS = {"remote_error": "ValueError", "timeout": "RPCTimeoutError"}
REQUIRED_KINDS = (
    *EXPECTED_ERRORS,
    "noop",
    "coro_noop",
    "tensor_inline",
    "tensor_shm",
    "rref_method",
    "rref_to_here",
    "rref_fork",
    "rref_local",
    "autograd_forward",
    "autograd_backward",
    "optimizer_step",
)
"""Calls every worker must have made: a stream that made none was stuck."""


@dataclass
class Proc:
    rank: int
    popen: subprocess.Popen[bytes]
    log: Path
    out: Path

    def describe_exit(self) -> str:
        code = self.popen.returncode
        if code is None:
            return "still running (killed by the soak)"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit {code}"

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(f"  | {line}" for line in lines[-LOG_TAIL:])


def spawn(args: argparse.Namespace, workdir: Path) -> list[Proc]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(WORLD):
        log, out = workdir / f"w{rank}.log", workdir / f"w{rank}.json"
        command = [
            sys.executable,
            str(WORKER),
            str(rank),
            str(WORLD),
            str(port),
            str(out),
            f"--duration={args.duration}",
            f"--sample-every={args.sample_every}",
        ]
        with log.open("wb") as sink:
            popen = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT
            )
        procs.append(Proc(rank, popen, log, out))
    return procs


def last_sample(p: Proc) -> dict[str, Any] | None:
    """The latest sample a worker printed to its log, if any."""
    prefix = f"[w{p.rank}] "
    lines = p.log.read_text(errors="replace").splitlines()
    for line in reversed(lines):
        if line.startswith(prefix + "{"):
            return dict(json.loads(line[len(prefix) :]))
    return None


def progress_cell(p: Proc) -> str:
    s = last_sample(p)
    if s is None:
        return f"w{p.rank} starting"
    return f"w{p.rank} {s['issued']:,} calls, {s['unexpected']} unexpected, {s['rss_mb']:.0f} MB"


def wait(procs: list[Proc], limit_s: float, every_s: float) -> list[str]:
    """Wait for every worker to exit, printing progress every ``every_s``.  After a
    crash the others are told to stop early (SIGUSR1: they drain, shut down and
    report) and get AFTER_A_CRASH_S; anything past the limit is killed.  Returns what
    went wrong."""
    started = time.monotonic()
    deadline = started + limit_s
    next_progress = started + every_s
    problems = []
    while [p for p in procs if p.popen.poll() is None]:  # (polls every one of them)
        if time.monotonic() > next_progress:
            cells = " | ".join(progress_cell(p) for p in procs)
            print(f"soak: {time.monotonic() - started:4.0f}s  {cells}", file=sys.stderr)
            next_progress += every_s
        crashed = any(p.popen.returncode not in (None, 0) for p in procs)
        if crashed and deadline > time.monotonic() + AFTER_A_CRASH_S:
            deadline = time.monotonic() + AFTER_A_CRASH_S
            for p in procs:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGUSR1)
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for p in procs:
        if p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait(timeout=30)
            problems.append(f"w{p.rank} did not finish in time and was killed")
        elif p.popen.returncode != 0:
            problems.append(f"w{p.rank} crashed: {p.describe_exit()}")
    return problems


def load_report(p: Proc) -> dict[str, Any] | None:
    try:
        return dict(json.loads(p.out.read_text()))
    except (OSError, ValueError):
        return None


def judge(name: str, report: dict[str, Any]) -> list[str]:
    """What is wrong in one worker's report."""
    problems = []
    totals = report["totals"]
    lost = totals["issued"] - totals["completed"] - totals["failed"]
    if lost or report["lost"]:
        problems.append(f"{name}: {lost} lost calls (never ended): {report['lost'][:5]}")
    unexpected = {kind: s for kind, s in report["kinds"].items() if s["unexpected"]}
    if unexpected:
        counts = ", ".join(f"{kind} {s['unexpected']}" for kind, s in unexpected.items())
        samples = [x for s in unexpected.values() for x in s["unexpected_samples"][:1]]
        total = sum(s["unexpected"] for s in unexpected.values())
        problems.append(f"{name}: {total} unexpected outcomes ({counts}), e.g. {samples[:3]}")
    for kind in REQUIRED_KINDS:
        if not report["kinds"].get(kind, {}).get("issued"):
            problems.append(f"{name}: no {kind} call was made")
    if report["crashed"]:
        problems.append(f"{name}: traffic streams crashed: {report['crashed']}")
    left = {k: v for k, v in report["left_at_close"].items() if v}
    if left:
        problems.append(f"{name}: left at close: {left}")
    losses = report["losses"]
    if report["steps"] >= 10 and not losses[-1] < losses[0]:
        problems.append(f"{name}: the autograd steps did not train: loss {losses}")
    return problems


# -- the summary ----------------------------------------------------------------------


def expected_failures(report: dict[str, Any]) -> tuple[int, int]:
    """(failures asked for, other failures) of one worker."""
    asked = sum(
        report["kinds"].get(kind, {}).get("failed", {}).get(error, 0)
        for kind, error in EXPECTED_ERRORS.items()
    )
    return asked, report["totals"]["failed"] - asked


def worker_rows(procs: list[Proc], reports: list[dict[str, Any] | None], duration: float) -> str:
    lines = [
        "| worker | issued | completed | failed as asked | other failures | unexpected | "
        "lost | calls/s | RSS first → last (max) MB | loop lag p99 / max (after warm-up) | exit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for p, r in zip(procs, reports, strict=True):
        if r is None:
            lines.append(f"| w{p.rank} | no report | | | | | | | | | {p.describe_exit()} |")
            continue
        t = r["totals"]
        asked, other = expected_failures(r)
        rss = [s["rss_mb"] for s in r["samples"]]
        steady = steady_lag_ms(r["samples"], duration)
        lost = t["issued"] - t["completed"] - t["failed"]
        lines.append(
            f"| w{p.rank} | {t['issued']:,} | {t['completed']:,} | {asked:,} | {other:,} | "
            f"{t['unexpected']} | {lost} | {t['issued'] / duration:,.0f} | "
            f"{rss[0]:.0f} → {rss[-1]:.0f} ({max(rss):.0f}) | "
            f"{r['loop_lag_ms']['p99']:.0f} / {r['loop_lag_max_ms']:.0f} ms ({steady:.0f} ms) | "
            f"{p.describe_exit()} |"
        )
    return "\n".join(lines)


def steady_lag_ms(samples: list[dict[str, Any]], duration: float) -> float:
    """The worst loop lag once warmed up (samples from min(10 s, duration / 4) on)."""
    warm = min(10.0, duration / 4)
    return max((s["loop_lag_max_ms"] for s in samples if s["t"] >= warm), default=0.0)


def kind_rows(reports: list[dict[str, Any] | None]) -> str:
    merged: dict[str, dict[str, Any]] = {}
    for r in filter(None, reports):
        for kind, s in r["kinds"].items():
            m = merged.setdefault(kind, {"issued": 0, "completed": 0, "failed": {}, "unexp": 0})
            m["issued"] += s["issued"]
            m["completed"] += s["completed"]
            m["unexp"] += s["unexpected"]
            for error, n in s["failed"].items():
                m["failed"][error] = m["failed"].get(error, 0) + n
    lines = [
        "| calls | issued | completed | failed (by type) | unexpected |",
        "|---|---:|---:|---|---:|",
    ]
    for kind, m in sorted(merged.items()):
        failed = ", ".join(f"{e} {n:,}" for e, n in sorted(m["failed"].items())) or "0"
        lines.append(f"| {kind} | {m['issued']:,} | {m['completed']:,} | {failed} | {m['unexp']} |")
    return "\n".join(lines)


def rss_lines(reports: list[dict[str, Any] | None], points: int = 13) -> str:
    lines = []
    for r in filter(None, reports):
        samples = r["samples"]
        step = max(1, (len(samples) - 1) // (points - 1))
        picked = samples[::step]
        if picked[-1] is not samples[-1]:
            picked.append(samples[-1])
        cells = " ".join(
            f"{s['t']:.0f}s:{s['rss_mb']:.0f}/{s['rss_shared_mb']:.0f}" for s in picked
        )
        lines.append(f"  {r['worker']} RSS/shared MB over time: {cells}")
    return "\n".join(lines)


def summary(
    procs: list[Proc], reports: list[dict[str, Any] | None], args: argparse.Namespace
) -> str:
    return "\n\n".join(
        [
            f"soak: {WORLD} workers, {args.duration:.0f} s of traffic",
            worker_rows(procs, reports, args.duration),
            kind_rows(reports),
            rss_lines(reports),
        ]
    )


# -- main -------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    parser.add_argument(
        "--sample-every",
        type=float,
        default=None,
        help="seconds between samples (default: duration/20, at least 1)",
    )
    parser.add_argument("--json", type=Path, help="write the full report here")
    args = parser.parse_args()
    if args.sample_every is None:
        args.sample_every = max(1.0, args.duration / 20)
    return args


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        procs = spawn(args, Path(tmp))
        try:
            limit = STARTUP_S + args.duration + WIND_DOWN_S
            problems = wait(procs, limit, every_s=max(10.0, args.duration / 10))
        finally:
            for p in procs:
                if p.popen.poll() is None:
                    p.popen.kill()
                    p.popen.wait()
        reports = [load_report(p) for p in procs]
        for p, r in zip(procs, reports, strict=True):
            if r is None:
                problems.append(f"w{p.rank} wrote no report ({p.describe_exit()})")
            else:
                problems += judge(f"w{p.rank}", r)
        if problems:
            for p in procs:
                print(
                    f"--- w{p.rank} ({p.describe_exit()}), last lines:\n{p.tail()}", file=sys.stderr
                )
        text = summary(procs, reports, args)
        workers = [
            {"rank": p.rank, "exit_code": p.popen.returncode, "report": r}
            for p, r in zip(procs, reports, strict=True)
        ]
    return {
        "duration_s": args.duration,
        "ok": not problems,
        "problems": problems,
        "workers": workers,
    }, text


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    result, text = run(args)
    result["wall_s"] = round(time.monotonic() - started, 1)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if result["problems"]:
        print(
            "\nSOAK FAILED:\n" + "\n".join(f"  - {p}" for p in result["problems"]), file=sys.stderr
        )
        return 1
    print(
        f"\nsoak passed: no lost call, no unexpected failure, every worker exited 0 "
        f"({result['wall_s']:.0f} s wall)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
