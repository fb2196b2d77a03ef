"""RPC calls as spans in ``torch.profiler`` (Kineto) traces, on both sides of a call.

Theory of operation
-------------------
While a profiler runs (``torch.profiler.profile``, or the legacy autograd
profiler), every call becomes named spans in the worker's trace:

* on the caller, ``rpc_async#<function> -> <callee> [call <id>@<caller>]``, from
  ``rpc_async`` to the call's end (its reply, deadline or lost link);
* on the callee, ``rpc_queued#<function> <- <caller> [call <id>@<caller>]`` from the
  request's arrival until its function starts (a pool call: until a pool thread
  takes it), then ``rpc_run#<function> <- <caller> [call <id>@<caller>]`` until its
  reply is about to be written (a pool call: its encoding and the hop back to the
  loop included), so that it lies within the caller's span.

The suffix ``[call <id>@<caller>]`` is the same on both sides, so two workers'
chrome traces can be matched span by span (``match_calls`` does it).

A span is a RecordFunction (``torch._C._profiler._RecordFunctionFast``, whose
context manager is entered and exited by hand, at different times): under a
profiler, under a microsecond to begin and end one, where the
``torch.ops.profiler._record_function_enter_new`` and ``_record_function_exit``
that ``record_function`` uses took some 25 us, through the op dispatcher.  Its
clock is the profiler's own, so spans line up with the torch ops around them.
One begun on a thread the profiler does not trace records nothing (its end says
so with a RuntimeError, which :func:`end` drops).

Which threads are traced: ``torch.profiler.profile()`` by default traces only the
thread that entered it (and the threads torch itself hands work to), and a span
begun or ended on another thread is lost or left unfinished.  So enter it on the
agent's event loop thread (every span but one is begun and ended there), or pass
``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``.
The one exception is a pool call's switch from queued to running: under
``profile_all_threads`` it is made in the pool thread that takes the call, and
its run span lies on that thread in the trace, around the torch ops of the
function; under a profiler of the loop thread alone (``torch._C._autograd.
_profiler_enabled()`` is true there only then) the pool threads are not traced,
so the switch is made on the loop when the call is handed to the pool, and the
wait for a free thread counts as running.

Cost: the hooks in the agent check :func:`profiling` once per call on each side
(a read of a Python global that the profiler sets on entry: some 40 ns with the
call), then test a field for None; without a profiler nothing else here runs
(about 0.15 us per call, both sides).  Under one, a call's three spans cost
about 8 us.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd import profiler as _torch_profiler

_RecordFunction = torch._C._profiler._RecordFunctionFast

CALLER, QUEUED, RUN = "rpc_async#", "rpc_queued#", "rpc_run#"
_CALL_ID = re.compile(r" \[call (\d+@[^\]]+)\]$")


def profiling() -> bool:
    """Whether a torch profiler runs in this process: the one check a call makes."""
    return _torch_profiler._is_profiler_enabled


def call_tag(call_id: int, caller: str) -> str:
    """The suffix that names one call the same way in both workers' traces."""
    return f" [call {call_id}@{caller}]"


def begin(name: str) -> Any:
    """A span that starts now; end it with :func:`end` (on another thread only under
    ``profile_all_threads``)."""
    span = _RecordFunction(name)
    span.__enter__()
    return span


def end(span: Any) -> None:
    with contextlib.suppress(RuntimeError):  # begun where no profiler traces: no record
        span.__exit__(None, None, None)


def begin_call(function: str, callee: str, call_id: int, caller: str) -> Any:
    """The caller's span of one call."""
    return begin(f"{CALLER}{function} -> {callee}{call_tag(call_id, caller)}")


class ServedSpan:
    """The callee's two spans of one call: queued (from now), then run."""

    __slots__ = ("_ended", "_label", "_loop_only", "_queued", "_run")

    def __init__(self, function: str, caller: str, call_id: int) -> None:
        self._label = f"{function} <- {caller}{call_tag(call_id, caller)}"
        # True if this (the loop) thread is traced by a thread-local profiler; False
        # under profile_all_threads (or when the loop is not traced at all).
        self._loop_only = torch._C._autograd._profiler_enabled()
        self._queued: Any = begin(QUEUED + self._label)
        self._run: Any = None
        self._ended = False

    def placed(self, pool: bool) -> None:
        """On the loop: the call starts, or (``pool``) waits for a pool thread, which
        counts as its start where the pool threads are not traced."""
        if not pool or self._loop_only:
            self._switch()

    def taken(self) -> None:
        """In the pool thread that took the call, before its function runs."""
        if not self._loop_only:
            self._switch()

    def ended(self) -> None:
        """The call's reply is about to be written (or it failed, or nobody waits any
        more)."""
        if not self._ended:
            self._ended = True
            end(self._queued if self._run is None else self._run)

    def _switch(self) -> None:
        """From queued to running."""
        if not self._ended and self._run is None:
            end(self._queued)
            self._run = begin(RUN + self._label)


def match_calls(*traces: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Chrome trace events (``export_chrome_trace`` output, loaded) of RPC spans, by
    call tag (``"<id>@<caller>"``) and span kind (``rpc_async#``, ``rpc_queued#``,
    ``rpc_run#``), from any number of workers' traces."""
    calls: dict[str, dict[str, dict[str, Any]]] = {}
    for event in _events(traces):
        name = event.get("name", "")
        found = _CALL_ID.search(name) if isinstance(name, str) else None
        kind = next((k for k in (CALLER, QUEUED, RUN) if name.startswith(k)), None)
        if found and kind and event.get("ph") == "X":
            calls.setdefault(found.group(1), {})[kind] = event
    return calls


def _events(traces: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    for trace in traces:
        yield from trace.get("traceEvents", [])
