"""Settings and helpers shared by the benchmark driver and its worker processes."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
CALLEE = "server"
"""The serving process: the last rank of every job; the other ranks (``w0``...) drive."""
Results = dict[str, Any]
WORKLOADS = ("calls", "cold", "steady", "bandwidth", "fanin", "spread", "tcp", "veth")
"""What one job of fresh processes runs (bench_rpc.py's docstring describes each)."""
BATCH, FEATURES, CLASSES = 32, 256, 10
"""Shape of the model-parallel step: a float32 batch of BATCH x FEATURES, CLASSES labels."""


@dataclass(frozen=True, slots=True)
class Config:
    """How much work each workload does; ``quick`` is the smoke-test size."""

    warmup_calls: int
    batches: int
    calls_per_batch: int
    window: int
    pipelined_warmup: int
    pipelined_calls: int
    pipelined_repeats: int
    sizes_mb: tuple[int, ...]
    echo_repeats: tuple[int, ...]
    echo_warmup: int
    bandwidth_sizes: tuple[int, ...]
    bandwidth_bytes: int
    bandwidth_max_repeats: int
    fanin_clients: tuple[int, ...]
    fanin_window: int
    fanin_warmup: int
    fanin_calls: int
    fanin_repeats: int
    spread_pairs: int
    spread_warmup: int
    spread_calls: int
    step_warmup: int
    step_batches: int
    steps_per_batch: int
    rpc_timeout: float
    step_timeout: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def call_counts(self) -> tuple[int, int, int]:
        """Warm-up calls, batches and calls per batch of the sequential call rows."""
        return self.warmup_calls, self.batches, self.calls_per_batch

    @property
    def step_counts(self) -> tuple[int, int, int]:
        """Warm-up steps, batches and steps per batch of the model-parallel step row."""
        return self.step_warmup, self.step_batches, self.steps_per_batch

    @property
    def echo_sizes(self) -> list[tuple[int, int]]:
        """(bytes, timed repeats) of the tensor echo, steady and cold rows."""
        return [(mb * MB, n) for mb, n in zip(self.sizes_mb, self.echo_repeats, strict=True)]

    def bandwidth_repeats(self, nbytes: int) -> int:
        """Timed echoes of one point of the bandwidth curve: fewer for larger tensors."""
        return max(3, min(self.bandwidth_max_repeats, self.bandwidth_bytes // nbytes))


def powers_of_4(smallest: int, largest: int) -> tuple[int, ...]:
    """``smallest``, 4 times it, ... up to ``largest`` (bytes)."""
    sizes = [smallest]
    while sizes[-1] * 4 <= largest:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


def size_label(nbytes: int) -> str:
    """``1K``, ``64M``, ``400M``, ``1G``: a size in the largest binary unit it is a whole of."""
    for unit, suffix in ((GB, "G"), (MB, "M"), (KB, "K")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return f"{nbytes}B"


FULL = Config(
    warmup_calls=500,
    batches=5,
    calls_per_batch=2000,
    window=256,
    pipelined_warmup=2000,
    pipelined_calls=20_000,
    pipelined_repeats=3,
    sizes_mb=(4, 64, 400),
    echo_repeats=(20, 10, 5),
    echo_warmup=2,
    bandwidth_sizes=powers_of_4(KB, GB),
    bandwidth_bytes=GB,
    bandwidth_max_repeats=200,
    fanin_clients=(1, 2, 4, 8),
    fanin_window=64,
    fanin_warmup=500,
    fanin_calls=4000,
    fanin_repeats=3,
    spread_pairs=6,
    spread_warmup=500,
    spread_calls=2000,
    step_warmup=50,
    step_batches=5,
    steps_per_batch=100,
    rpc_timeout=120.0,
    step_timeout=150.0,
)

QUICK = Config(
    warmup_calls=50,
    batches=3,
    calls_per_batch=200,
    window=256,
    pipelined_warmup=256,
    pipelined_calls=2000,
    pipelined_repeats=1,
    sizes_mb=(4,),
    echo_repeats=(5,),
    echo_warmup=2,
    bandwidth_sizes=powers_of_4(KB, 4 * MB),
    bandwidth_bytes=16 * MB,
    bandwidth_max_repeats=20,
    fanin_clients=(1, 2),
    fanin_window=64,
    fanin_warmup=256,
    fanin_calls=1000,
    fanin_repeats=1,
    spread_pairs=2,
    spread_warmup=50,
    spread_calls=300,
    step_warmup=20,
    step_batches=3,
    steps_per_batch=30,
    rpc_timeout=30.0,
    step_timeout=30.0,
)


def config(quick: bool) -> Config:
    return QUICK if quick else FULL


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """Command line of a worker process (see ``bench_rpc.spawn_worker``)."""

    rank: int
    world_size: int
    port: int
    out: Path
    workload: str
    size: int | None
    quick: bool
    cpu: int | None
    host: str = "127.0.0.1"
    """The rendezvous host: rank 0's address (``veth``: its namespace's end of the pair)."""

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def tcp_only(self) -> bool:
        """Both frameworks forced onto TCP (``tcp``, and ``veth`` across namespaces)."""
        return self.workload in ("tcp", "veth")

    @property
    def name(self) -> str:
        return worker_name(self.rank, self.world_size)

    @property
    def serves(self) -> bool:
        return self.name == CALLEE

    @property
    def clients(self) -> int:
        """How many ranks drive the workload (all but the server)."""
        return self.world_size - 1

    @property
    def results_path(self) -> Path:
        return results_path(self.out, self.rank)


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (Agg); None, after a warning, without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("warning: matplotlib is not installed (pip install -e '.[dev]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def worker_name(rank: int, world_size: int) -> str:
    return CALLEE if rank == world_size - 1 else f"w{rank}"


def results_path(out: Path, rank: int) -> Path:
    """Where driving rank ``rank`` writes its results, in the job's folder ``out``."""
    return out / f"rank{rank}.json"


def parse_worker_args(argv: Sequence[str] | None = None) -> WorkerArgs:
    parser = argparse.ArgumentParser(description="one benchmark worker (started by bench_rpc.py)")
    parser.add_argument("rank", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("out", type=Path, help="folder where driving ranks write their results")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workload", choices=WORKLOADS, default="calls")
    parser.add_argument(
        "--size", type=int, help="tensor size in bytes (cold, bandwidth, tcp, veth)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu", type=int, help="run every thread of this process on this CPU")
    parser.add_argument("--host", default="127.0.0.1", help="the rendezvous host (rank 0's)")
    ns = parser.parse_args(argv)
    if not 0 <= ns.rank < ns.world_size:
        parser.error(f"rank {ns.rank} is outside a world of {ns.world_size}")
    return WorkerArgs(
        ns.rank, ns.world_size, ns.port, ns.out, ns.workload, ns.size, ns.quick, ns.cpu, ns.host
    )


def pin_to(cpu: int | None) -> None:
    """Bind this process's threads (those alive now, and so those they start) to ``cpu``."""
    if cpu is None:
        return
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})


def make_tensor(nbytes: int) -> torch.Tensor:
    """A float32 tensor of ``nbytes`` bytes with recognisable values at both ends."""
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    tensor[0], tensor[-1] = 3.0, 7.0
    return tensor


def check_echo(sent: torch.Tensor, received: object) -> None:
    """Fail loudly if an echo did not bring the same tensor back."""
    if not isinstance(received, torch.Tensor) or not torch.equal(sent, received):
        raise AssertionError("echo returned a different value than it was sent")


class Echoes:
    """What both workers' ``echo_ms`` do around each echo of one tensor, so that both
    frameworks run the same workload: ``cfg.echo_warmup`` untimed echoes first, the
    first echo checked, and with ``keep_previous`` each result kept referenced until
    the next one has arrived (as ``prev = <call>`` keeps it)."""

    def __init__(self, cfg: Config, nbytes: int, repeats: int, *, keep_previous: bool) -> None:
        self.tensor = make_tensor(nbytes)
        self.rounds = range(cfg.echo_warmup + repeats)
        self._warmup = cfg.echo_warmup
        self._keep_previous = keep_previous
        self._alive: list[object] = []
        self._times: list[float] = []

    def record(self, index: int, result: object, elapsed_ns: int) -> None:
        """Echo ``index`` brought ``result`` back in ``elapsed_ns``."""
        if index == 0:
            check_echo(self.tensor, result)
        if index >= self._warmup:
            self._times.append(elapsed_ns / 1e6)
        self._alive[:] = [result] if self._keep_previous else []

    def results(self) -> Results:
        """The timed echoes' round trips, in ms."""
        return summary(self._times)


def check_value(expected: object, received: object) -> None:
    """Fail loudly if a call brought back something other than ``expected``."""
    if received != expected:
        raise AssertionError(f"expected {expected!r} back, got {received!r}")


STATE_DICT_BLOCKS, STATE_DICT_CHANNELS = 50, 16
"""The state-dict row's model: this many Conv2d(C, C, 3) + BatchNorm2d(C) blocks, C this."""


def make_state_dict() -> dict[str, torch.Tensor]:
    """A model's state dict, as a parameter server is pushed gradients or a trainer
    pulls weights: 300 tensors (conv weights of 9 KB, batch-norm vectors of 64 bytes,
    0-d step counters), 0.5 MB in all."""
    torch.manual_seed(0)
    c = STATE_DICT_CHANNELS
    layers: list[torch.nn.Module] = []
    for _ in range(STATE_DICT_BLOCKS):
        layers += [torch.nn.Conv2d(c, c, 3, bias=False), torch.nn.BatchNorm2d(c)]
    state: dict[str, torch.Tensor] = torch.nn.Sequential(*layers).state_dict()
    return state  # (an OrderedDict, as users send it)


def make_stage1() -> torch.nn.Module:
    """Stage 1 of the model-parallel MLP, kept on the driver (stage 2 is ``Stage2``)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), torch.nn.ReLU())


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch every model-parallel step trains on: inputs and class labels."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    return inputs, labels


def check_trained(first_loss: torch.Tensor, last_loss: torch.Tensor) -> None:
    """Fail loudly if training steps on one fixed batch did not lower its loss."""
    if not float(last_loss) < float(first_loss):
        raise AssertionError(f"loss did not fall: {float(first_loss)} -> {float(last_loss)}")


def ns_to_us(elapsed_ns: int, calls: int) -> float:
    return elapsed_ns / calls / 1e3


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentiles(samples: list[float]) -> Results:
    """p10, p50 and p90 of per-call samples (the samples themselves are not kept)."""
    deciles = statistics.quantiles(samples, n=10)
    return {"p10": deciles[0], "p50": median(samples), "p90": deciles[-1], "count": len(samples)}


def summary(samples: list[float]) -> Results:
    """A measurement: its median and the samples it was taken from."""
    return {"median": median(samples), "samples": samples}


def write_results(path: Path, results: Results) -> None:
    path.write_text(json.dumps(results, indent=2, sort_keys=True))


async def sequential_us(
    cfg: Config,
    once: Callable[[], Awaitable[Any]],
    counts: tuple[int, int, int] | None = None,
) -> Results:
    """Mean time of ``await once()`` run back to back, per batch, after a warm-up (the
    asyncio workers' rows; torch's worker times its blocking calls the same way).

    ``counts`` is (warm-up, batches, calls per batch); by default ``cfg.call_counts``.
    """
    warmup, batches, per_batch = counts or cfg.call_counts
    for _ in range(warmup):
        await once()
    per_call = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(per_batch):
            await once()
        per_call.append(ns_to_us(time.perf_counter_ns() - start, per_batch))
    return summary(per_call)


async def trained_step_us(cfg: Config, step: Callable[[], Awaitable[torch.Tensor]]) -> Results:
    """``sequential_us`` of a model-parallel step (``cfg.step_counts``), checking that the
    steps lowered the loss (``step()`` returns it)."""
    first = await step()
    result = await sequential_us(cfg, step, cfg.step_counts)
    check_trained(first, await step())
    return result
