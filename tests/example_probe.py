"""Run an example script as one torchrun worker, and say where its worker listened.

``python -m tests.example_probe examples/NAME.py ARGS`` runs the script as ``__main__``
(as ``python examples/NAME.py ARGS`` would) with ``asyncrpc.shutdown`` wrapped: as the
worker starts to leave the job, it prints one line, ``PROBE {...}``: its name, rank,
the addresses it published (``tcp://host:port``, ``unix://@...``), the store it met the others at
(``MASTER_ADDR``), its links (``get_debug_info()["links"]``), and how many times its
torchrun agent had restarted its worker group (``TORCHELASTIC_RESTART_COUNT``: 0 in the
first attempt).  Used by
tests/integration/test_multihost.py, which runs examples under torchrun across network
namespaces and must see each worker listen on its own namespace's address.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import asyncrpc
from asyncrpc.api import _agent

PROBE_PREFIX = "PROBE "
_shutdown = asyncrpc.shutdown


async def probed_shutdown(*args: Any, **kwargs: Any) -> None:
    """Print the ``PROBE`` line, then ``asyncrpc.shutdown``."""
    agent = _agent()
    probe = {
        "name": agent.info.name,
        "rank": agent.info.id,
        "addresses": agent.address.addresses,
        "master_addr": os.environ.get("MASTER_ADDR"),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "links": asyncrpc.get_debug_info()["links"],
    }
    print(PROBE_PREFIX + json.dumps(probe), flush=True)
    await _shutdown(*args, **kwargs)


def main() -> None:
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(script.parent))  # the examples import their _launch and such
    asyncrpc.shutdown = probed_shutdown
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
