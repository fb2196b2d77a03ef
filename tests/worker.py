"""One worker process of an integration-test job (see tests/cluster.py)."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys

import uvloop

from tests import scenarios
from tests.cluster import RESULT_PREFIX


def main() -> None:
    name, rank, world, port, loop, transport = sys.argv[1:7]
    module, _, function = name.rpartition(".")  # "module.scenario" or a tests.scenarios name
    source = importlib.import_module(f"tests.{module}") if module else scenarios
    scenario = getattr(source, function)
    run = uvloop.run if loop == "uvloop" else asyncio.run
    config = scenarios.Config(int(rank), int(world), int(port), transport)
    result = run(scenario(config))
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
