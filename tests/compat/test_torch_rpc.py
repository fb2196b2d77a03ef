"""torch's RPC test suites (rpc_test, dist_autograd_test, dist_optimizer_test, examples)
against asyncrpc.compat; see tests/compat/torch_suite.py and docs/compat.md.

By default a quick subset runs (``make test``); ``ASYNCRPC_COMPAT_FULL=1`` runs every
in-scope test (``make compat``).  Out-of-scope tests and known failures are skipped
with their reason.
"""

from __future__ import annotations

import os

os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")  # per test, all ranks

from tests.compat import torch_suite  # installs compat as torch.distributed.rpc

# The quick subset: the public API's main paths, a few seconds each.
QUICK: dict[str, set[str]] = {
    "RpcTest": {
        "test_add",
        "test_nested_rpc",
        "test_py_raise_in_user_func",
        "test_rpc_timeouts",
        "test_remote_with_exception",
        "test_rref_forward_chain",
        "test_return_future",
        "test_async_function_simple",
        "test_wait_all",
        "test_worker_info_pickle",
        "test_rref_proxy_class",
        "test_graceful_shutdown_with_uneven_workload",
    },
    "DistAutogradTest": {"test_backward_simple", "test_nested_context"},
    "DistOptimizerTest": {"test_dist_optim"},
    "ParameterServerTest": {"test_batch_updating_parameter_server"},
}

# Tests in scope that fail under compat: "Suite.test" -> why (docs/compat.md).
KNOWN_FAILURES: dict[str, str] = {}

_full = os.environ.get("ASYNCRPC_COMPAT_FULL") == "1"
globals().update(torch_suite.generate(__name__, None if _full else QUICK, KNOWN_FAILURES))
