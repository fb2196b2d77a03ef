"""An HTTP inference service: aiohttp in front, batched model replicas behind it, over asyncrpc.

One process, ``frontend``, serves HTTP with aiohttp and is also an asyncrpc worker; it
starts ``--models`` model workers (``model0``, ``model1``, ... on loopback), each serving
the same torch MLP (weights drawn from a fixed seed, so every replica -- and a test --
computes the same numbers).

* ``POST /predict`` takes JSON, ``{"inputs": [[...], ...]}`` or ``{"input": [...]}``
  (``FEATURES`` = 16 floats a row), and answers ``{"outputs": ...}`` or ``{"output": ...}``;
  or raw tensor bytes (``Content-Type: application/octet-stream`` with headers
  ``X-Dtype: float32`` and ``X-Shape: 4,16``), answered with raw bytes and the output's
  ``X-Dtype`` and ``X-Shape``.
* Each input row is one call, ``Replicas.rpc_async(predict_rows, args=(row,))``: the
  replicas send it to the live model worker with the fewest calls outstanding.
  ``predict_rows`` is an ``@asyncrpc.functions.batch`` function, so the rows of all the
  requests that reach a worker together run as one forward pass.  It runs on the
  worker's event loop with ``max_wait=0``: a batch starts as soon as the worker is free,
  and the rows that arrive during a pass make up the next one -- batches grow with the
  load, and a lone request never waits for company.
* Errors become HTTP statuses: a malformed body, an unknown dtype, a shape that does not
  match the bytes or a wrong number of features is 400 with a JSON ``{"error": ...}``
  (another Content-Type, 415); a full batch queue (``OverloadedError``) is 429; no live
  model worker (``PeerLostError``) is 503, at once; a model call that times out, 504.
  Predictions have no side effects, so the replicas are ``idempotent``: a call lost
  with its worker is sent to another one.
* ``GET /health`` asks every model worker how many forward passes it ran over how many
  rows, and reports each one as live or not, with the calls it has outstanding (503
  when none is live).

By default it runs a short demo against itself: concurrent clients send JSON and raw
requests, check every answer against the same MLP computed locally, and halfway through
kill ``model0`` -- the requests keep succeeding on the other replicas.  It prints
``RESULT`` lines: ``requests_ok``, ``requests_failed``, ``max_abs_error`` (against the
local MLP), ``mean_batch_size`` (rows per forward pass on the live workers) and
``requests_per_s`` (over the whole demo).  ``--smoke`` is a smaller, quiet one.

    python examples/inference_service.py                  # the demo, 2 model workers
    python examples/inference_service.py --serve --port 8000
    curl -s localhost:8000/predict -H 'Content-Type: application/json' \\
        -d '{"input": [0.1, 0.2, ...16 floats...]}'
    curl -s localhost:8000/health

``--no-batch`` serves the same MLP one row per call (``predict_one``), for comparison
(``benchmarks/bench_service.py`` measures both); ``--max-queue`` and ``--model-delay``
make overload easy to see.  The test suite imports this module (``run_service``,
``build_app``) and runs the script with ``--smoke``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch
from aiohttp import web
from torch import Tensor, nn

import asyncrpc
from asyncrpc.functions import batch
from asyncrpc.rendezvous import free_port
from asyncrpc.serving import Replicas

FEATURES, HIDDEN, CLASSES = 16, 64, 4
DEPTH = 256  # hidden blocks: a forward pass costs about as much for 1 row as for 64
WEIGHTS_SEED = 2024
MAX_ROWS = 1024  # rows per request
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16}
FRONTEND = "frontend"
RAW = "application/octet-stream"


# --- the model (on each model worker) ------------------------------------------------------


def build_model(depth: int = DEPTH) -> nn.Sequential:
    """The MLP every replica serves: FEATURES -> HIDDEN, then ``depth`` blocks of
    LayerNorm -> ReLU -> Linear(HIDDEN, HIDDEN), then -> CLASSES.

    Narrow and deep on purpose: a forward pass is hundreds of small torch ops whose
    fixed cost per op, not the arithmetic, is most of its time, so 64 rows cost
    little more than 1 -- as on a GPU, where each op is a kernel launch.  The weights
    come from a generator seeded with WEIGHTS_SEED (He-scaled, biases 0), so every
    process that builds it gets the same numbers.
    """
    generator = torch.Generator().manual_seed(WEIGHTS_SEED)

    def linear(fan_in: int, fan_out: int) -> nn.Linear:
        layer = nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            weight = torch.randn(fan_out, fan_in, generator=generator)
            layer.weight.copy_(weight * math.sqrt(2.0 / fan_in))
            layer.bias.zero_()
        return layer

    layers: list[nn.Module] = [linear(FEATURES, HIDDEN)]
    for _ in range(depth):
        layers += [nn.LayerNorm(HIDDEN), nn.ReLU(), linear(HIDDEN, HIDDEN)]
    layers.append(linear(HIDDEN, CLASSES))
    return nn.Sequential(*layers).eval()


class Loaded:
    """This model worker's model, set by :func:`load_model` before it serves."""

    net: nn.Module | None = None
    delay = 0.0  # extra seconds per forward pass (--model-delay: a slower model)
    passes = 0  # forward passes run
    rows = 0  # rows they ran over


async def forward(rows: Tensor) -> Tensor:
    """The model over a ``(n, FEATURES)`` batch: ``(n, CLASSES)``, on the worker's loop.

    The forward pass runs on the event loop, not in the worker's thread pool: it is
    many small torch ops, each of which lets go of the GIL and takes it back, so a pool
    thread running it would fight the loop thread for the GIL at every layer (several
    times slower on a busy worker).  A model worker runs one model; while a pass runs,
    the calls that arrive wait in the socket, and join the next batch.
    """
    if Loaded.net is None:
        raise RuntimeError("no model loaded on this worker")
    if Loaded.delay:
        await asyncio.sleep(Loaded.delay)  # a slower model, say one waiting on a device
    with torch.no_grad():
        out: Tensor = Loaded.net(rows)
    Loaded.passes += 1
    Loaded.rows += len(rows)
    return out


@batch(max_size=64, max_wait=0.0, max_queue=1024)
async def predict_rows(rows: list[Tensor]) -> Tensor:
    """Batched: callers send one row each; the worker runs one forward over the batch."""
    return await forward(torch.stack(rows))  # row i of the output is caller i's result


async def predict_one(row: Tensor) -> Tensor:
    """Unbatched (``--no-batch``): one forward pass per row."""
    return (await forward(row.unsqueeze(0)))[0]


async def worker_status() -> dict[str, Any]:
    """A model worker's figures (``/health`` asks each worker for them): forward passes
    and the rows they ran over, and the rows waiting for a batch."""
    waiting = predict_rows.stats().get("waiting", 0)  # {} before its first call
    return {"passes": Loaded.passes, "rows": Loaded.rows, "waiting": waiting}


def load_model(args: argparse.Namespace) -> None:
    """On a model worker, before it serves: build the model and set the batching limits.

    The limits of ``@batch`` are fixed when the function is made, and its queue lives on
    the worker that runs it; the frontend only names it (a batched function is pickled by
    name).  So each model worker remakes ``predict_rows`` with the command line's limits.
    """
    global predict_rows
    Loaded.net = build_model(args.depth)
    Loaded.delay = args.model_delay
    predict_rows = batch(max_size=args.max_batch, max_wait=args.max_wait, max_queue=args.max_queue)(
        predict_rows.fn
    )


async def serve_model(rank: int, world: int, args: argparse.Namespace) -> None:
    """A model worker: load the model, join the job, serve until the frontend leaves."""
    load_model(args)  # before joining: once in the job, the loop must stay free
    await asyncrpc.init_rpc(f"model{rank - 1}", rank=rank, world_size=world, init_method="env://")
    await asyncrpc.shutdown()  # waits for the frontend to shut down (or die)


# --- the model workers' processes (started by the frontend) --------------------------------


class ModelWorkers:
    """The model worker processes a frontend starts on loopback: ranks 1..n of its job."""

    def __init__(self, args: argparse.Namespace, store_port: int) -> None:
        self.names = [f"model{i}" for i in range(args.models)]
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store_port),
            "WORLD_SIZE": str(args.models + 1),
            "PYTHONUNBUFFERED": "1",
        }
        command = [sys.executable, __file__, *model_argv(args)]
        self.procs = {
            name: subprocess.Popen(command, env={**env, "RANK": str(rank)})
            for rank, name in enumerate(self.names, start=1)
        }

    def kill(self, name: str, timeout: float = 10.0) -> None:
        """Kill one model worker (SIGKILL) and wait for it to be gone."""
        self.procs[name].kill()
        self.procs[name].wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` for every worker to exit; kill the ones still running."""
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def model_argv(args: argparse.Namespace) -> list[str]:
    """The command line that gives a model worker the frontend's model settings."""
    return [
        *("--depth", str(args.depth), "--model-delay", str(args.model_delay)),
        *("--max-batch", str(args.max_batch), "--max-wait", str(args.max_wait)),
        *("--max-queue", str(args.max_queue)),
        *(("--smoke",) if args.smoke else ()),
    ]


# --- the HTTP front end ---------------------------------------------------------------------


class InputError(ValueError):
    """A request the service cannot read: answered with ``status`` and the message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Frontend:
    """What the handlers share: the replicas, and which function they call."""

    replicas: Replicas
    batched: bool = True
    timeout: float = 30.0

    async def predict(self, rows: Tensor) -> Tensor:
        """Every row is one call to a replica; the outputs, in order."""
        fn: Callable[[Any], Any] = predict_rows if self.batched else predict_one
        calls = [self.replicas.rpc_async(fn, args=(row,), timeout=self.timeout) for row in rows]
        outputs: list[Tensor] = []
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):  # (gathered all: none is left behind)
                raise result
            outputs.append(result)
        return torch.stack(outputs)

    async def health(self) -> dict[str, Any]:
        """Each model worker: live or not, its outstanding calls and its figures."""
        statuses = await asyncio.gather(*(self.probe(w) for w in self.replicas.workers))
        return dict(zip(self.replicas.workers, statuses, strict=True))

    async def probe(self, worker: str) -> dict[str, Any]:
        """Ask one worker for its figures; one that is gone is marked lost at once."""
        status: dict[str, Any] = {"outstanding": self.replicas.outstanding[worker]}
        try:
            figures = await asyncrpc.rpc_async(worker, worker_status, timeout=2.0)
        except asyncrpc.PeerLostError as exc:
            self.replicas.mark_lost(worker)  # no request has to find out
            return {"live": False, "error": str(exc), **status}
        except asyncrpc.RPCTimeoutError:
            return {"live": False, "error": "did not answer within 2 s", **status}
        return {"live": True, **status, **figures}


SERVICE = web.AppKey("frontend", Frontend)


def build_app(
    replicas: Replicas, *, batched: bool = True, timeout: float = 30.0
) -> web.Application:
    """The aiohttp application: ``POST /predict`` and ``GET /health`` over ``replicas``."""
    app = web.Application()
    app[SERVICE] = Frontend(replicas, batched, timeout)
    app.router.add_post("/predict", predict)
    app.router.add_get("/health", health)
    return app


async def predict(request: web.Request) -> web.Response:
    """``POST /predict``: JSON in, JSON out; raw bytes in, raw bytes out."""
    frontend = request.app[SERVICE]
    try:
        rows, single, dtype = await read_request(request)
        outputs = await frontend.predict(rows)
    except InputError as exc:
        return error(exc.status, str(exc))
    except asyncrpc.OverloadedError:
        return error(429, "the model workers are overloaded; retry later", {"Retry-After": "1"})
    except asyncrpc.PeerLostError:
        return error(503, "no live model worker")
    except asyncrpc.RPCTimeoutError:
        return error(504, f"no answer from a model worker within {frontend.timeout} s")
    if single:
        outputs = outputs[0]
    if dtype is None:
        return web.json_response({"output" if single else "outputs": outputs.tolist()})
    return raw_response(outputs.to(dtype))


async def read_request(request: web.Request) -> tuple[Tensor, bool, torch.dtype | None]:
    """The rows (float32), whether the request sent one row alone, and the dtype to
    answer raw bytes in (None: answer JSON)."""
    if request.content_type == RAW:
        return read_raw(request.headers, await request.read())
    if request.content_type == "application/json":
        return (*read_json(await request.read()), None)
    raise InputError(f"Content-Type must be application/json or {RAW}", status=415)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: every model worker's state; 503 when none is live."""
    workers = await request.app[SERVICE].health()
    live = sum(w["live"] for w in workers.values())
    return web.json_response({"live": live, "workers": workers}, status=200 if live else 503)


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def read_json(body: bytes) -> tuple[Tensor, bool]:
    """``{"inputs": [[...], ...]}`` or ``{"input": [...]}``: the rows, and whether single."""
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise InputError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict) or len(payload.keys() & {"input", "inputs"}) != 1:
        raise InputError('expected a JSON object with "inputs": [[...], ...] or "input": [...]')
    single = "input" in payload
    rows = [payload["input"]] if single else payload["inputs"]
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise InputError('"inputs" must be a list of rows, "input" one row (a list of numbers)')
    if not all(is_number(x) for row in rows for x in row):
        raise InputError("every input value must be a number")
    if any(len(row) != FEATURES for row in rows):
        raise InputError(f"every row must have {FEATURES} features")
    return checked(torch.tensor(rows, dtype=torch.float32).reshape(-1, FEATURES)), single


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_raw(headers: Any, body: bytes) -> tuple[Tensor, bool, torch.dtype]:
    """Raw bytes of ``X-Dtype`` and ``X-Shape``: the rows (float32), single, the dtype."""
    dtype = DTYPES.get(headers.get("X-Dtype", ""))
    if dtype is None:
        raise InputError(f"X-Dtype must be one of {', '.join(DTYPES)}")
    try:
        shape = [int(n) for n in headers.get("X-Shape", "").split(",")]
    except ValueError:
        raise InputError("X-Shape must be the dimensions, such as 4,16") from None
    if len(shape) not in (1, 2) or shape[-1] != FEATURES or min(shape) < 0:
        raise InputError(f"X-Shape must be {FEATURES} or ROWS,{FEATURES}")
    if len(body) != math.prod(shape) * dtype.itemsize:
        raise InputError(
            f"the body has {len(body)} bytes; X-Shape {shape} of "
            f"{headers['X-Dtype']} needs {math.prod(shape) * dtype.itemsize}"
        )
    rows = torch.frombuffer(bytearray(body), dtype=dtype).reshape(-1, FEATURES)
    return checked(rows.float()), len(shape) == 1, dtype


def checked(rows: Tensor) -> Tensor:
    """The rows, if there are some, not too many, and all finite."""
    if not 0 < len(rows) <= MAX_ROWS:
        raise InputError(f"a request has 1 to {MAX_ROWS} rows")
    if not torch.isfinite(rows).all():
        raise InputError("every input value must be finite")
    return rows


def raw_response(outputs: Tensor) -> web.Response:
    """Raw bytes of ``outputs``, with its dtype and shape in the headers."""
    headers = {
        "X-Dtype": str(outputs.dtype).removeprefix("torch."),
        "X-Shape": ",".join(str(n) for n in outputs.shape),
    }
    return web.Response(body=outputs.numpy().tobytes(), content_type=RAW, headers=headers)


# --- running it -----------------------------------------------------------------------------


@dataclass
class Service:
    """A running service: its URL, its model workers' processes, and its front end."""

    url: str
    workers: ModelWorkers
    frontend: Frontend


@contextlib.asynccontextmanager
async def run_service(
    args: argparse.Namespace, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[Service]:
    """Start the model workers, join their job as ``frontend`` and serve HTTP on
    ``host:port`` (0: any free port); on exit, stop all of it."""
    store_port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        workers = ModelWorkers(args, store_port)
        stack.callback(workers.stop)
        await asyncrpc.init_rpc(
            FRONTEND,
            rank=0,
            world_size=args.models + 1,
            init_method=f"tcp://127.0.0.1:{store_port}",
            rpc_timeout=args.timeout,
        )
        stack.push_async_callback(asyncrpc.shutdown, timeout=10.0)
        replicas = Replicas(workers.names, idempotent=True)
        app = build_app(replicas, batched=not args.no_batch, timeout=args.timeout)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        yield Service(f"http://{bound_host}:{bound_port}", workers, app[SERVICE])


async def serve_forever(args: argparse.Namespace) -> None:
    """``--serve``: serve until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with run_service(args, port=args.port) as service:
        print(f"SERVING {service.url}", flush=True)
        await stop.wait()


@dataclass
class DemoTally:
    """What the demo's clients saw."""

    ok: int = 0
    failed: int = 0
    max_error: float = 0.0


async def demo(args: argparse.Namespace) -> None:
    """Run the service, load it with checked requests, kill model0 halfway, report."""
    model = build_model(args.depth)
    tally = DemoTally()
    async with run_service(args) as service, aiohttp.ClientSession(service.url) as session:
        started = time.perf_counter()
        half = args.requests // 2
        await load(session, model, tally, half, args.concurrency)
        if len(service.workers.names) > 1:
            say(args, "demo: killing model0; the other replicas take its calls")
            service.workers.kill("model0")
        await load(session, model, tally, args.requests - half, args.concurrency)
        elapsed = time.perf_counter() - started
        async with session.get("/health", timeout=aiohttp.ClientTimeout(10)) as answer:
            workers = (await answer.json())["workers"]
    say(args, f"health at the end: {json.dumps(workers)}")
    live = [w for w in workers.values() if w["live"]]
    mean_batch = sum(w["rows"] for w in live) / max(1, sum(w["passes"] for w in live))
    print(f"RESULT requests_ok={tally.ok}")
    print(f"RESULT requests_failed={tally.failed}")
    print(f"RESULT max_abs_error={tally.max_error:.3g}")
    print(f"RESULT mean_batch_size={mean_batch:.2f}")
    print(f"RESULT requests_per_s={args.requests / elapsed:.1f}", flush=True)


async def load(
    session: aiohttp.ClientSession, model: nn.Module, tally: DemoTally, count: int, clients: int
) -> None:
    """``count`` requests from ``clients`` concurrent clients; each answer checked."""
    generator = torch.Generator().manual_seed(tally.ok + tally.failed)
    inputs = [torch.randn(1 + i % 4, FEATURES, generator=generator) for i in range(count)]
    queue = iter(enumerate(inputs))

    async def client() -> None:
        for i, x in queue:
            try:
                got = await (ask_raw(session, x) if i % 2 else ask_json(session, x))
            except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
                print(f"demo: request {i} failed: {exc!r}", file=sys.stderr)
                tally.failed += 1
                continue
            with torch.no_grad():
                tally.max_error = max(tally.max_error, (got - model(x)).abs().max().item())
            tally.ok += 1

    await asyncio.gather(*(client() for _ in range(clients)))


async def ask_json(session: aiohttp.ClientSession, x: Tensor) -> Tensor:
    """POST rows as JSON; the outputs."""
    timeout = aiohttp.ClientTimeout(30)
    async with session.post("/predict", json={"inputs": x.tolist()}, timeout=timeout) as answer:
        body = await answer.json()
    if answer.status != 200:
        raise RuntimeError(f"HTTP {answer.status}: {body}")
    return torch.tensor(body["outputs"])


async def ask_raw(session: aiohttp.ClientSession, x: Tensor) -> Tensor:
    """POST rows as raw float32 bytes; the outputs."""
    headers = raw_headers(x)
    timeout = aiohttp.ClientTimeout(30)
    data = x.numpy().tobytes()
    async with session.post("/predict", data=data, headers=headers, timeout=timeout) as answer:
        body = await answer.read()
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status}: {body!r}")
        shape = [int(n) for n in answer.headers["X-Shape"].split(",")]
    return torch.frombuffer(bytearray(body), dtype=torch.float32).reshape(shape)


def raw_headers(x: Tensor) -> dict[str, str]:
    """The headers of a raw request carrying ``x``."""
    return {
        "Content-Type": RAW,
        "X-Dtype": str(x.dtype).removeprefix("torch."),
        "X-Shape": ",".join(str(n) for n in x.shape),
    }


def say(args: argparse.Namespace, line: str) -> None:
    if not args.smoke:
        print(line, flush=True)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=2, help="model worker processes")
    parser.add_argument("--serve", action="store_true", help="serve until Ctrl-C (no demo)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: any free one)")
    parser.add_argument("--smoke", action="store_true", help="a small, fast, quiet demo")
    parser.add_argument("--requests", type=int, default=None, help="demo requests (400)")
    parser.add_argument("--concurrency", type=int, default=16, help="demo clients")
    parser.add_argument("--no-batch", action="store_true", help="one forward pass per row")
    parser.add_argument("--depth", type=int, default=DEPTH, help="hidden blocks of the MLP")
    parser.add_argument("--max-batch", type=int, default=64, help="rows per forward pass")
    parser.add_argument("--max-wait", type=float, default=0.0, help="seconds a row may wait")
    parser.add_argument("--max-queue", type=int, default=1024, help="rows waiting per worker")
    parser.add_argument("--model-delay", type=float, default=0.0, help="extra s per forward")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per model call")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """A model worker when RANK is set (the frontend starts them so), else the frontend."""
    import uvloop

    args = make_parser().parse_args(argv)
    if args.requests is None:
        args.requests = 60 if args.smoke else 400
    torch.set_num_threads(1)  # a few processes share the machine's cores
    if args.smoke:  # quiet: not even the warnings of a worker the demo killed
        logging.getLogger("asyncrpc").setLevel(logging.ERROR)
    if "RANK" in os.environ:
        uvloop.run(serve_model(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args))
    elif args.models < 1:
        raise SystemExit("--models must be at least 1")
    else:
        uvloop.run(serve_forever(args) if args.serve else demo(args))


if __name__ == "__main__":
    # Run as the module ``inference_service``, not as ``__main__``: batched functions
    # travel by name, and the frontend (this script, or a test that imports it) and
    # the model workers must all name them ``inference_service.predict_rows``.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import inference_service

    inference_service.main()
