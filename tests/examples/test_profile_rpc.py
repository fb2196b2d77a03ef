"""examples/profile_rpc.py: two workers' torch.profiler traces, matched call by call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrpc.agent.spans import CALLER, QUEUED, RUN, match_calls
from tests.examples.runner import run_example

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.mark.parametrize("flags", [[], ["--all-threads"]], ids=["loop-thread", "all-threads"])
def test_each_worker_writes_a_trace_whose_spans_match_the_others(
    tmp_path: Path, flags: list[str]
) -> None:
    results = run_example("profile_rpc", "--smoke", "--out", str(tmp_path), *flags)
    # 3 profiled steps, each a forward, a backward and an optimizer step on the ps
    assert results["spans_matched"] >= 9, results
    assert results["calls_unmatched"] == 0 and results["run_within_call"] == 1.0, results
    on_trainer, on_ps = (
        match_calls(json.loads((tmp_path / f"trace-{w}.json").read_text()))
        for w in ("trainer", "ps")
    )
    made = {tag: kinds[CALLER]["name"] for tag, kinds in on_trainer.items() if CALLER in kinds}
    to_ps = [tag for tag, name in made.items() if "-> ps " in name]
    assert to_ps and all({QUEUED, RUN} <= on_ps[tag].keys() for tag in to_ps)
    assert all(tag.endswith("@trainer") for tag in to_ps)
