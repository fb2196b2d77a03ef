"""torch's own RPC test suites, run against asyncrpc.compat.

Theory of operation
-------------------
torch ships its RPC tests in the wheel (``torch.testing._internal.distributed.rpc``).
They reach RPC only through the modules ``torch.distributed.rpc`` and
``torch.distributed.autograd`` (and ``DistributedOptimizer`` / ``RemoteModule``
from ``torch.distributed.optim`` / ``.nn``), and take the backend from a fixture
mixed into each suite.  :func:`install` puts asyncrpc.compat's modules in
``sys.modules`` (and on the ``torch.distributed`` package) under those names,
replacing torch's: a name compat lacks is then missing (or, if private, a
stand-in that raises when used), never torch's TensorPipe implementation passing
for ours.  It must run before any torch test module is imported.

:func:`classify` sorts every test by what it uses, from its source (and that of
the ``self._helper`` methods it calls): CUDA, TorchScript, the faulty agent, the
legacy profiler, TensorPipe-only options, or torch internals put a test out of
scope; a test that uses only the public API, or also one of the private helpers
compat provides (``SHIMS``), is in scope.  :func:`generate` mixes each suite with
:class:`CompatFixture` and :class:`ForkHelper` (workers start with ``fork``: ~1 s
a test here instead of ~24 s with ``spawn``).
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
import unittest
from typing import Any

import torch
import torch.distributed

import asyncrpc.compat
import asyncrpc.compat.autograd
import asyncrpc.compat.nn
import asyncrpc.compat.optim
import asyncrpc.compat.rpc


def install() -> None:
    """Make ``torch.distributed.rpc`` / ``.autograd`` asyncrpc.compat's, in this process
    and (by fork) its workers; override only the two classes in ``optim`` and ``nn``."""
    import torch.distributed.nn  # these import torch's rpc first:
    import torch.distributed.optim  # let them, then swap the modules

    rpc = asyncrpc.compat.rpc
    modules: dict[str, Any] = {
        "torch.distributed.rpc": rpc,
        "torch.distributed.autograd": asyncrpc.compat.autograd,
    }
    for sub in ("api", "functions", "internal", "constants", "backend_registry", "options"):
        modules[f"torch.distributed.rpc.{sub}"] = getattr(rpc, sub)
    for name in [m for m in sys.modules if m.startswith("torch.distributed.rpc.")]:
        if name not in modules:
            del sys.modules[name]  # torch's own rpc submodules: not reachable by name
    sys.modules.update(modules)
    torch.distributed.rpc = rpc  # type: ignore[attr-defined]
    torch.distributed.autograd = asyncrpc.compat.autograd  # type: ignore[attr-defined]
    torch.distributed.optim.DistributedOptimizer = asyncrpc.compat.optim.DistributedOptimizer
    torch.distributed.nn.RemoteModule = asyncrpc.compat.nn.RemoteModule


install()

# ruff: noqa: E402  (the torch test modules must be imported after install())
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.distributed.rpc import (
    dist_autograd_test,
    dist_optimizer_test,
    rpc_test,
)
from torch.testing._internal.distributed.rpc.examples import (
    parameter_server_test,
    reinforcement_learning_rpc_test,
)
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

SUITES: list[type] = [
    rpc_test.RpcTest,
    rpc_test.TensorPipeAgentRpcTest,
    rpc_test.CudaRpcTest,
    rpc_test.TensorPipeAgentCudaRpcTest,
    dist_autograd_test.DistAutogradTest,
    dist_autograd_test.TensorPipeAgentDistAutogradTest,
    dist_autograd_test.CudaDistAutogradTest,
    dist_autograd_test.FaultyAgentDistAutogradTest,
    dist_autograd_test.TensorPipeCudaDistAutogradTest,
    dist_optimizer_test.DistOptimizerTest,
    parameter_server_test.ParameterServerTest,
    reinforcement_learning_rpc_test.ReinforcementLearningRpcTest,
]

# The private torch helpers compat provides (docs/compat.md).
SHIMS = (
    "_set_rpc_timeout",
    "_get_type",
    "_retrieve_context",
    "_current_context",
    "_wait_all",
    "_wait_all_workers",
    "_barrier",
    "get_worker_infos",
    "_get_current_rpc_agent",
    "_rref_context_get_debug_info",
)

# What puts a test out of scope, first match wins: (reason, pattern in its source).
OUT_OF_SCOPE: list[tuple[str, str]] = [
    ("CUDA", r"cuda|skip_if_lt_x_gpu|_gpu\b"),
    ("faulty agent", r"faulty_messages|messages_to_delay|_set_delay"),
    ("legacy RPC profiler", r"profil|record_function|_server_process_global_profile"),
    ("TorchScript", r"torch\.jit|script"),
    (
        "TensorPipe options or agent",
        r"_transports|_channels|device_map|set_devices|TensorPipeAgent|FooBackendOptions"
        r"|_init_rpc_backend|rpc_backend_options\.\w+\s*=|StubRpcAgent|_get_device_map",
    ),
    (
        "torch autograd internals",
        r"_send_functions|_recv_functions|_known_worker_ids|dist_autograd\._get_debug_info"
        r"|_get_max_id|(?<!\w)_init\(|next_functions|dist_autograd\._\w+",
    ),
    (
        "torch RPC internals",
        r"_internal_rpc_pickler|_use_rpc_pickler|_thread_local_var|PythonUDF|RPCExecMode"
        r"|_build_rpc_profiling_key|wait_until_pending_futures_and_users_flushed"
        r"|wait_until_owners_and_forks_on_rank|_delete_all_user_and_unforked_owner_rrefs"
        r"|_get_debug_info|_get_future|_ignore_rref_leak|rpc\._\w+|api\._\w+|_rref_leak"
        r"|_get_profiling_future|_cleanup|_reset|_destroy|mock\.patch|enable_gil_profiling"
        r"|_set_and_start_rpc_agent|_is_current_rpc_agent_set|_serialize|_deserialize",
    ),
]


def source_of(suite: type, name: str, seen: set[str] | None = None) -> str:
    """The source of test ``name`` and of the ``self._helpers`` it calls (recursively)."""
    seen = set() if seen is None else seen
    seen.add(name)
    try:
        text = textwrap.dedent(inspect.getsource(getattr(suite, name)))
    except (OSError, TypeError):
        return ""
    for helper in re.findall(r"self\.(_\w+)\(", text):
        if helper not in seen and callable(getattr(suite, helper, None)):
            text += "\n" + source_of(suite, helper, seen)
    return text


def _without_shims(text: str) -> str:
    for shim in SHIMS:
        text = re.sub(rf"(rpc\.|api\.|dist_autograd\.|\.)?{shim}\b", "SHIM", text)
    return text


def classify(suite: type, name: str) -> tuple[str, str]:
    """``("public" | "shim" | "out", reason)`` for one test of ``suite``."""
    if suite.__name__.startswith(("Cuda", "TensorPipeCuda", "TensorPipeAgentCuda")):
        return "out", "CUDA"
    if suite.__name__.startswith("Faulty"):
        return "out", "faulty agent"
    owner = next(k for k in suite.__mro__ if name in vars(k))
    if suite.__name__.startswith("TensorPipe") and owner is not suite:
        return "out", f"duplicate: inherited from {owner.__name__}, run in the generic suite"
    text = source_of(suite, name)
    if "DDP" in text or "DistributedDataParallel" in text:
        return "out", "DDP"
    used_shim = _without_shims(text) != text
    for reason, pattern in OUT_OF_SCOPE:
        if re.search(pattern, _without_shims(text)):
            return "out", reason
    return ("shim", "uses a compat shim") if used_shim else ("public", "")


def tests_of(suite: type) -> list[str]:
    """The test methods of ``suite``, in name order."""
    return sorted(n for n in dir(suite) if n.startswith("test") and callable(getattr(suite, n)))


class CompatFixture(RpcAgentTestFixture):
    """torch's agent fixture, for asyncrpc.compat (file:// rendezvous by default)."""

    @property
    def rpc_backend(self) -> Any:
        return asyncrpc.compat.rpc.backend_registry.BackendType.TENSORPIPE

    @property
    def rpc_backend_options(self) -> Any:
        return asyncrpc.compat.rpc.TensorPipeRpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self) -> str:
        return ".*"

    def get_timeout_error_regex(self) -> str:
        return "timed out after|got no answer|was not made within"


class ForkHelper(MultiProcessTestCase):
    """torch's SpawnHelper, starting the workers with ``fork``."""

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


def _skipped(reason: str) -> Any:
    @unittest.skip(reason)
    def test(self: Any) -> None:
        pass

    return test


def generate(
    module_name: str, selected: dict[str, set[str]] | None, known: dict[str, str]
) -> dict[str, type]:
    """One class per suite, ``Compat<Suite>``, with out-of-scope tests, tests not in
    ``selected`` (suite name -> test names; None: all) and ``known`` failures
    (``"Suite.test"`` -> reason) skipped with their reason."""
    classes: dict[str, type] = {}
    for suite in SUITES:
        body: dict[str, Any] = {}
        for name in tests_of(suite):
            kind, reason = classify(suite, name)
            key = f"{suite.__name__}.{name}"
            if kind == "out":
                body[name] = _skipped(f"out of scope: {reason}")
            elif key in known:
                body[name] = _skipped(f"known failure: {known[key]}")
            elif selected is not None and name not in selected.get(suite.__name__, set()):
                body[name] = _skipped("not in the quick subset (make compat runs it)")
        cls = type(f"Compat{suite.__name__}", (suite, CompatFixture, ForkHelper), body)
        cls.__module__ = module_name
        classes[cls.__name__] = cls
    return classes


def report(known_failures: dict[str, str]) -> None:
    """Print the results table of docs/compat.md: per suite, the tests, those out of
    scope, the public and shim ones, and how many pass (in scope and not a known
    failure: the full sweep, ``make compat``, is what shows that they do), then the
    out-of-scope reasons."""
    from collections import Counter

    print("| class | tests | out of scope | public | shim | pass | fail | pass (public) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    total: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for suite in SUITES:
        counts: Counter[str] = Counter()
        for name in tests_of(suite):
            kind, reason = classify(suite, name)
            counts["tests"] += 1
            counts[kind] += 1
            if kind == "out":
                reasons[reason] += 1
            elif f"{suite.__name__}.{name}" in known_failures:
                counts["fail"] += 1
            else:
                counts["pass"] += 1
                counts["pass (public)"] += kind == "public"
        total.update(counts)
        print(_row(suite.__name__, counts))
    print(_row("**total**", total))
    print("out of scope:", dict(reasons))


def _row(label: str, counts: Any) -> str:
    columns = ("tests", "out", "public", "shim", "pass", "fail", "pass (public)")
    return f"| {label} | " + " | ".join(str(counts[c]) for c in columns) + " |"


if __name__ == "__main__":
    from tests.compat.test_torch_rpc import KNOWN_FAILURES

    report(KNOWN_FAILURES)
