"""Distributed autograd, DistributedOptimizer and RemoteModule across three agents on one
loop: every gradient must equal the local computation's (float64, 1e-6)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from asyncrpc import RRef, autograd, nn, optim, remote
from asyncrpc.agent import (
    AgentOptions,
    RpcAgent,
    async_execution,
    current_agent,
    on_loop,
    set_default_agent,
)
from asyncrpc.autograd.context import contexts_of
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(60)
Agents = tuple[RpcAgent, RpcAgent, RpcAgent]


@pytest.fixture
async def trio() -> AsyncIterator[Agents]:
    async with joined_agents("abc", AgentOptions(transports=("unix",), rpc_timeout=20)) as agents:
        for agent in agents:
            contexts_of(agent)  # (init_rpc does this)
        set_default_agent(agents[0])
        yield agents[0], agents[1], agents[2]
        set_default_agent(None)


def weights(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()


W_B = weights(4, 3, seed=1)  # lives on b
W_C = weights(3, 2, seed=2)  # lives on c


def stage_b(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ W_B)


def stage_c(h: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(h @ W_C)


async def stage_b_calls_c(h: torch.Tensor) -> torch.Tensor:
    """A callee that itself calls another worker inside the forward pass."""
    from asyncrpc.agent import current_agent

    agent = current_agent()
    assert agent is not None
    inner = await agent.rpc_async("c", stage_c, (stage_b(h),))
    return inner * 2 + h[:, :2]


def local_grads(loss_fn: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> list[Any]:
    return list(torch.autograd.grad(loss_fn(), params))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-6, rtol=0)


def grads_on(agent: RpcAgent, context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    return dict(contexts_of(agent).get(context_id).grads)


async def contexts_everywhere(agents: Agents) -> list[int]:
    """Contexts alive on each agent, once the releases they sent are done."""
    for agent in agents:
        await contexts_of(agent).released()
    return [a.debug_info()["autograd_contexts"] for a in agents]


async def test_two_stage_chain(trio: Agents) -> None:
    a, b, _ = trio
    w_a, x = weights(5, 4, seed=3), weights(2, 5, seed=4).detach()
    async with autograd.context() as ctx:
        h = torch.relu(x @ w_a)
        y = await a.rpc_async("b", stage_b, (h,))
        loss = (y * y).sum() + h.sum()
        await autograd.backward(ctx, [loss])
        got_a, got_b = autograd.get_gradients(ctx)[w_a], grads_on(b, ctx)[W_B]
        assert (await contexts_everywhere(trio))[:2] == [1, 1]
    assert a.debug_info()["autograd_contexts"] == 0  # here at once; b's is on its way

    def local() -> torch.Tensor:
        h = torch.relu(x @ w_a)
        y = stage_b(h)
        return (y * y).sum() + h.sum()

    want_a, want_b = local_grads(local, [w_a, W_B])
    assert close(got_a, want_a) and close(got_b, want_b)
    assert w_a.grad is None and W_B.grad is None  # gradients live in the context
    assert (await contexts_everywhere(trio)) == [0, 0, 0]


async def stage_b_task(h: torch.Tensor) -> torch.Tensor:
    return stage_b(h)


@async_execution
def stage_b_awaitable(h: torch.Tensor) -> asyncio.Future[torch.Tensor]:
    done: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
    done.set_result(stage_b(h))
    return done


@on_loop
def stage_b_inline(h: torch.Tensor) -> torch.Tensor:
    return stage_b(h)


@pytest.mark.parametrize(
    "callee",
    [stage_b, stage_b_task, stage_b_awaitable, stage_b_inline],
    ids=["thread", "loop", "awaitable", "inline"],
)
async def test_results_are_recorded_wherever_the_callee_runs(
    trio: Agents, callee: Callable[[torch.Tensor], Any]
) -> None:
    a, b, _ = trio
    w_a, x = weights(5, 4, seed=3), weights(2, 5, seed=4).detach()
    async with autograd.context() as ctx:
        y = await a.rpc_async("b", callee, (x @ w_a,))
        await autograd.backward(ctx, [y.sum()])
        got_a, got_b = autograd.get_gradients(ctx)[w_a], grads_on(b, ctx)[W_B]
    want_a, want_b = local_grads(lambda: stage_b(x @ w_a).sum(), [w_a, W_B])
    assert close(got_a, want_a) and close(got_b, want_b)


async def test_nested_calls_across_three_workers(trio: Agents) -> None:
    a, b, c = trio
    w_a, x = weights(5, 4, seed=5), weights(3, 5, seed=6).detach()
    async with autograd.context() as ctx:
        h = x @ w_a
        y = await a.rpc_async("b", stage_b_calls_c, (h,))
        await autograd.backward(ctx, [y.pow(2).sum()])
        got = [autograd.get_gradients(ctx)[w_a], grads_on(b, ctx)[W_B], grads_on(c, ctx)[W_C]]

    def local() -> torch.Tensor:
        h = x @ w_a
        return (stage_c(stage_b(h)) * 2 + h[:, :2]).pow(2).sum()

    want = local_grads(local, [w_a, W_B, W_C])
    assert all(close(g, w) for g, w in zip(got, want, strict=True))
    assert (await contexts_everywhere(trio)) == [0, 0, 0]  # released on c too, through b


async def test_tensor_used_twice_diamond(trio: Agents) -> None:
    a, b, c = trio
    w_a, x = weights(5, 4, seed=7), weights(2, 5, seed=8).detach()
    async with autograd.context() as ctx:
        h = torch.tanh(x @ w_a)
        left, right = await asyncio.gather(
            a.rpc_async("b", stage_b, (h,)), a.rpc_async("b", stage_b, (h * 3,))
        )
        via_c = await a.rpc_async("c", stage_c, (left,))
        await autograd.backward(ctx, [(via_c.sum() + (left * right).sum())])
        got = [autograd.get_gradients(ctx)[w_a], grads_on(b, ctx)[W_B], grads_on(c, ctx)[W_C]]

    def local() -> torch.Tensor:
        h = torch.tanh(x @ w_a)
        left, right = stage_b(h), stage_b(h * 3)
        return stage_c(left).sum() + (left * right).sum()

    want = local_grads(local, [w_a, W_B, W_C])
    assert all(close(g, w) for g, w in zip(got, want, strict=True))


class Stage:
    def __init__(self, seed: int) -> None:
        self.w = weights(4, 3, seed=seed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.w)

    def weight(self) -> torch.Tensor:
        return self.w


async def test_results_of_to_here_and_proxies(trio: Agents) -> None:
    _, b, _ = trio
    stage = remote("b", Stage, (9,))
    w_a, x = weights(5, 4, seed=10), weights(2, 5, seed=11).detach()
    async with autograd.context() as ctx:
        h = x @ w_a
        y = await stage.rpc_async().forward(h)
        remote_y = stage.remote().forward(h * 2)
        y2 = await remote_y.to_here()
        w_copy = await stage.rpc_async().weight()  # a parameter itself, as a result
        await autograd.backward(ctx, [(y * y2).sum() + w_copy.sum()])
        got = [autograd.get_gradients(ctx)[w_a]]
        owner_w = (await stage.to_here()).w  # (a copy; compare with the owner's grads)
        got.append(next(g for t, g in grads_on(b, ctx).items() if t.shape == owner_w.shape))

    def local() -> torch.Tensor:
        h = x @ w_a
        return (torch.tanh(h @ owner_w) * torch.tanh(h * 2 @ owner_w)).sum() + owner_w.sum()

    owner_w.requires_grad_()
    want = local_grads(local, [w_a, owner_w])
    assert all(close(g, w) for g, w in zip(got, want, strict=True))


class Server:
    def __init__(self) -> None:
        self.w = weights(4, 1, seed=12)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w

    def parameter(self) -> RRef[torch.Tensor]:
        return RRef(self.w)


async def test_concurrent_contexts_against_one_server(trio: Agents) -> None:
    b = trio[1]
    server = remote("b", Server)
    w = (await server.to_here()).w
    xs = {seed: weights(3, 4, seed=seed).detach() * seed for seed in range(1, 5)}
    contexts: dict[int, int] = {}

    async def one(seed: int) -> None:
        async with autograd.context() as ctx:
            out = await server.rpc_async().forward(xs[seed])
            await autograd.backward(ctx, [out.pow(2).sum()])
            contexts[seed] = ctx
            got = next(iter(grads_on(b, ctx).values()))
            want = torch.autograd.grad((xs[seed] @ w).pow(2).sum(), [w])[0]
            assert close(got, want), seed

    await asyncio.gather(*(one(seed) for seed in xs))
    assert len(set(contexts.values())) == 4
    assert (await contexts_everywhere(trio)) == [0, 0, 0]


@pytest.mark.parametrize(
    ("optimizer", "args", "options"),
    [
        (torch.optim.SGD, (), {"lr": 0.1, "momentum": 0.9}),  # torch's functional twin
        (torch.optim.Adam, (), {"lr": 0.01}),  # functional twin
        (torch.optim.SGD, (0.1,), {"momentum": 0.9}),  # positional: the class itself
        (torch.optim.SGD, (), {"lr": 0.1, "foreach": None}),  # the twin takes no None
        (torch.optim.NAdam, (), {"lr": 0.01}),  # no twin
    ],
    ids=["sgd-twin", "adam-twin", "sgd-positional", "sgd-foreach-none", "nadam"],
)
async def test_optimizer_step_equals_local_step(
    trio: Agents,
    optimizer: type[torch.optim.Optimizer],
    args: tuple[Any, ...],
    options: dict[str, Any],
) -> None:
    a = trio[0]
    server = remote("b", Server)
    local_w = weights(4, 1, seed=12)  # the same start as the server's
    mine = weights(5, 4, seed=13)
    mine_copy = mine.detach().clone().requires_grad_()
    dist_opt = optim.DistributedOptimizer(
        optimizer, [await server.rpc_async().parameter(), RRef(mine)], *args, **options
    )
    local_opt = optimizer([local_w, mine_copy], *args, **options)
    x = weights(3, 5, seed=14).detach()
    for _ in range(3):
        async with autograd.context() as ctx:
            out = await server.rpc_async().forward(torch.tanh(x @ mine))
            await autograd.backward(ctx, [out.pow(2).sum()])
            await dist_opt.step(ctx)
        local_opt.zero_grad()
        (torch.tanh(x @ mine_copy) @ local_w).pow(2).sum().backward()
        local_opt.step()
    remote_w = (await server.to_here()).w
    assert close(remote_w, local_w) and close(mine, mine_copy)
    assert mine.grad is None and remote_w.grad is None  # gradients stay in the contexts
    assert a.debug_info()["autograd_contexts"] == 0


async def test_optimizer_arguments_are_checked_as_torch_checks_them(trio: Agents) -> None:
    server = remote("b", Server)
    params = [await server.rpc_async().parameter()]
    opt = optim.DistributedOptimizer(torch.optim.SGD, params, lr=-1.0)  # the twin would take it
    with pytest.raises(ValueError, match="Invalid learning rate"):
        async with autograd.context() as ctx:
            await opt.step(ctx)


class RefusingOptimizer(torch.optim.SGD):
    def __init__(self, params: Any) -> None:
        raise ValueError("this optimizer refuses its parameters")


async def test_optimizer_created_raises_an_owners_constructor_error(trio: Agents) -> None:
    server = remote("b", Server)
    params = [await server.rpc_async().parameter(), RRef(weights(2, seed=18))]
    fine = optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    await fine.created()  # both owners (b, and a itself) made theirs
    refused = optim.DistributedOptimizer(RefusingOptimizer, params)
    with pytest.raises(ValueError, match="refuses its parameters"):
        await refused.created()


def failing_stage(h: torch.Tensor) -> torch.Tensor:
    return BadBackward.apply(h)


class BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        return h * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward exploded on purpose")


async def test_failure_in_backward_raises_and_contexts_are_released(trio: Agents) -> None:
    a = trio[0]
    w_a = weights(3, 3, seed=15)
    with pytest.raises(RuntimeError, match="exploded") as caught:
        async with autograd.context() as ctx:
            y = await a.rpc_async("b", failing_stage, (w_a * 1,))
            await autograd.backward(ctx, [y.sum()])
    assert caught.value.remote_worker == "b"  # type: ignore[attr-defined]
    assert (await contexts_everywhere(trio)) == [0, 0, 0]


async def test_remote_module_embedding_bag_trains(trio: Agents) -> None:
    torch.manual_seed(0)
    embedding = nn.RemoteModule("b/cpu", torch.nn.EmbeddingBag, (50, 8), {"mode": "sum"})
    head = torch.nn.Linear(8, 2)
    params = await embedding.remote_parameters()
    params += [RRef(p) for p in head.parameters()]
    opt = optim.DistributedOptimizer(torch.optim.Adam, params, lr=0.05)
    generator = torch.Generator().manual_seed(1)
    indices = torch.randint(0, 50, (64, 4), generator=generator)
    labels = ((indices < 25).sum(1) >= 2).long()  # which half most of a bag's items are from
    losses = []
    await embedding.train()
    for _ in range(40):
        async with autograd.context() as ctx:
            features = await embedding.forward_async(indices)
            loss = torch.nn.functional.cross_entropy(head(features), labels)
            await autograd.backward(ctx, [loss])
            await opt.step(ctx)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert embedding.get_module_rref().owner_name() == "b"


async def test_rref_backward_runs_on_the_owner(trio: Agents) -> None:
    w_a = weights(2, 4, seed=16)
    async with autograd.context() as ctx:
        loss_rref = remote("b", scalar_loss, (w_a * 1,))
        await loss_rref.to_here()  # made inside the context, on b
        await loss_rref.backward(ctx)
        got = autograd.get_gradients(ctx)[w_a]
    want = torch.autograd.grad(scalar_loss(w_a * 1), [w_a])[0]
    assert close(got, want)


def scalar_loss(h: torch.Tensor) -> torch.Tensor:
    return (h @ W_B).pow(2).sum()


def add_to_rref(rref: RRef[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return RRef.local_value(rref) * 2 + h


async def add_to_rref_on(owner: str, rref: RRef[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """Made by ``remote()``: its nested call must run in the creator's autograd context."""
    agent = current_agent()
    assert agent is not None
    return await agent.rpc_async(owner, add_to_rref, (rref, h))  # type: ignore[no-any-return]


async def test_remote_value_made_by_a_nested_call_is_recorded(trio: Agents) -> None:
    c = trio[2]
    h = weights(3, 3, seed=19)
    async with autograd.context() as ctx:
        on_c = remote("c", weights, (3, 3), {"seed": 20})
        made_on_b = remote("b", add_to_rref_on, ("c", on_c, h * 1))
        await autograd.backward(ctx, [(await made_on_b.to_here()).pow(2).sum()])
        got_h = autograd.get_gradients(ctx)[h]
        w_c = await on_c.to_here()  # a copy: c's own tensor is its only leaf there
        (got_w_c,) = grads_on(c, ctx).values()
    want_h, want_w_c = torch.autograd.grad((w_c * 2 + h * 1).pow(2).sum(), [h, w_c])
    assert close(got_h, want_h) and close(got_w_c, want_w_c)


def identity(value: Any) -> Any:
    return value


async def test_rref_backward_waits_for_its_value_and_needs_a_tensor(trio: Agents) -> None:
    w_a = weights(2, 4, seed=17)
    async with autograd.context() as ctx:
        mine = remote("a", scalar_loss, (w_a * 1,))  # made in a pool thread: not yet made
        await mine.backward(ctx)
        got = autograd.get_gradients(ctx)[w_a]
        text = remote("b", identity, ("foo",))
        with pytest.raises(TypeError, match=r"RRef should contain a tensor for \.backward\(\)"):
            await text.backward(ctx)  # checked before b is asked for a context it never saw
    assert close(got, torch.autograd.grad(scalar_loss(w_a * 1), [w_a])[0])


async def test_backward_refuses_roots_it_cannot_start_from(trio: Agents) -> None:
    leaf = torch.ones(1, requires_grad=True)
    cases: list[tuple[list[Any], type[Exception], str]] = [
        ([], ValueError, "No tensors provided"),
        ([torch.ones(1)], ValueError, "requires_grad not set"),
        ([leaf * torch.ones(3)], ValueError, "is not a scalar, all roots need to be scalar"),
        ([leaf], ValueError, "does not have a valid gradient function"),
        (["loss"], TypeError, "not a tensor"),
    ]
    async with autograd.context() as ctx:
        for roots, error, message in cases:
            with pytest.raises(error, match=message):
                await autograd.backward(ctx, roots)


def remote_loss(h: torch.Tensor) -> torch.Tensor:
    return (stage_b(h) ** 2).sum()


async def test_backward_may_start_from_a_loss_computed_remotely(trio: Agents) -> None:
    """torch's received tensors have a recv function, so a loss returned by an RPC is a
    valid root there; here it arrives as a leaf of the context, and is one too."""
    a, b, _ = trio
    w_a, x = weights(5, 4, seed=3), weights(2, 5, seed=4).detach()
    async with autograd.context() as ctx:
        loss = await a.rpc_async("b", remote_loss, (x @ w_a,))
        assert loss.is_leaf and loss.requires_grad
        await autograd.backward(ctx, [loss])
        got_a, got_b = autograd.get_gradients(ctx)[w_a], grads_on(b, ctx)[W_B]
    want_a, want_b = local_grads(lambda: remote_loss(x @ w_a), [w_a, W_B])
    assert close(got_a, want_a) and close(got_b, want_b)
    with pytest.raises(ValueError, match="does not have a valid gradient function"):
        async with autograd.context() as other:  # received in another context: a leaf
            await autograd.backward(other, [loss])


async def test_contexts_a_lost_worker_opened_are_freed_on_the_survivors(trio: Agents) -> None:
    a, b, _ = trio
    x = weights(2, 4, seed=3)
    async with autograd.context() as ctx:  # a opens it; b holds its part
        await a.rpc_async("b", stage_b, (x,))
        assert ctx in contexts_of(b).live
        async with _opened_by(b) as theirs:  # and one b opened itself survives
            await b.rpc_async(
                "c", stage_c, (torch.ones(2, 3, dtype=torch.float64, requires_grad=True),)
            )
            await a.shutdown(graceful=False)  # a dies without releasing anything
            await asyncio.wait_for(_until(lambda: ctx not in contexts_of(b).live), 10)
            assert theirs in contexts_of(b).live


def _opened_by(agent: RpcAgent) -> Any:
    set_default_agent(agent)
    return autograd.context()


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


# -- sparse tensors: recorded as strided ones are, their gradients as torch gives them --

TO_SPARSE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "coo": torch.Tensor.to_sparse,
    "csr": torch.Tensor.to_sparse_csr,
}
sparse_layouts = pytest.mark.parametrize("layout", sorted(TO_SPARSE))


def sparse_leaf(layout: str, seed: int) -> torch.Tensor:
    """A 3x4 sparse leaf that requires grad, about half of its entries stored."""
    dense = weights(3, 4, seed=seed).detach()
    dense[dense.abs() < 0.7] = 0
    return TO_SPARSE[layout](dense).requires_grad_()


W_S = weights(4, 3, seed=20)  # multiplies sparse inputs (on b, or c)
S_B = {layout: sparse_leaf(layout, seed=21) for layout in TO_SPARSE}  # sparse, "on b"


def sparse_stage(h: torch.Tensor) -> torch.Tensor:
    """Sparse ``h`` in, dense out."""
    return torch.tanh(torch.sparse.mm(h, W_S))


def scaled(h: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse ``h`` in, sparse out."""
    return h * scale


def sparse_of_b(layout: str) -> torch.Tensor:
    """A sparse result computed from b's sparse leaf."""
    return S_B[layout] * 3


def sparse_loss(h: torch.Tensor) -> torch.Tensor:
    return sparse_stage(h).pow(2).sum()


async def sparse_via_c(h: torch.Tensor) -> torch.Tensor:
    """On b: sends a sparse tensor it received (scaled) on to c, inside the forward pass."""
    from asyncrpc.agent import current_agent

    agent = current_agent()
    assert agent is not None
    return await agent.rpc_async("c", sparse_stage, (h * 2,)) * 2


async def sparse_stage_of_rref(value: RRef[torch.Tensor]) -> torch.Tensor:
    """On c: fetches a sparse value held by its owner, inside the forward pass."""
    return sparse_stage(await value.to_here())


def same_gradient(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Of the layout torch's local backward gives, and equal to it."""
    return got.layout == want.layout and close(got.to_dense(), want.to_dense())


@sparse_layouts
async def test_sparse_argument_gets_its_gradient(trio: Agents, layout: str) -> None:
    a, b, _ = trio
    s = sparse_leaf(layout, seed=22)
    async with autograd.context() as ctx:
        y = await a.rpc_async("b", sparse_stage, (s * 2,))  # a sparse tensor with a graph
        z = await a.rpc_async("b", sparse_stage, (s,))  # the sparse leaf itself
        await autograd.backward(ctx, [(y * z).sum()])
        got_s, got_w = autograd.get_gradients(ctx)[s], grads_on(b, ctx)[W_S]

    def local() -> torch.Tensor:
        return (sparse_stage(s * 2) * sparse_stage(s)).sum()

    want_s, want_w = local_grads(local, [s, W_S])
    assert want_s.layout == s.layout  # (the local gradient is sparse itself)
    assert same_gradient(got_s, want_s) and close(got_w, want_w)
    assert (await contexts_everywhere(trio)) == [0, 0, 0]


@sparse_layouts
async def test_sparse_result_gets_its_gradient(trio: Agents, layout: str) -> None:
    a, b, _ = trio
    w_a = weights(4, 2, seed=23)
    async with autograd.context() as ctx:
        y = await a.rpc_async("b", sparse_of_b, (layout,))
        assert y.layout == S_B[layout].layout and y.requires_grad and y.is_leaf
        await autograd.backward(ctx, [torch.sparse.mm(y, w_a).pow(2).sum()])
        got_w, got_s = autograd.get_gradients(ctx)[w_a], grads_on(b, ctx)[S_B[layout]]
    want_w, want_s = local_grads(
        lambda: torch.sparse.mm(sparse_of_b(layout), w_a).pow(2).sum(), [w_a, S_B[layout]]
    )
    assert close(got_w, want_w) and same_gradient(got_s, want_s)


@sparse_layouts
async def test_sparse_value_of_an_rref(trio: Agents, layout: str) -> None:
    s, w_a = sparse_leaf(layout, seed=24), weights(4, 2, seed=25)
    async with autograd.context() as ctx:
        value = remote("b", scaled, (s, 3.0))
        y = await value.to_here()  # a sparse result of a call that carried no tensor
        await autograd.backward(ctx, [torch.sparse.mm(y, w_a).pow(2).sum()])
        got = [autograd.get_gradients(ctx)[t] for t in (s, w_a)]
    want = local_grads(lambda: torch.sparse.mm(scaled(s, 3.0), w_a).pow(2).sum(), [s, w_a])
    assert same_gradient(got[0], want[0]) and close(got[1], want[1])


@sparse_layouts
async def test_rref_backward_from_a_sparse_argument(trio: Agents, layout: str) -> None:
    b = trio[1]
    s = sparse_leaf(layout, seed=26)
    async with autograd.context() as ctx:
        loss = remote("b", sparse_loss, (s * 2,))
        await loss.to_here()
        await loss.backward(ctx)
        got_s, got_w = autograd.get_gradients(ctx)[s], grads_on(b, ctx)[W_S]
    want_s, want_w = local_grads(lambda: sparse_loss(s * 2), [s, W_S])
    assert same_gradient(got_s, want_s) and close(got_w, want_w)


@sparse_layouts
async def test_sparse_through_nested_calls(trio: Agents, layout: str) -> None:
    a, _, c = trio
    s = sparse_leaf(layout, seed=27)
    async with autograd.context() as ctx:
        y = await a.rpc_async("b", sparse_via_c, (s * 1.5,))  # b sends it on to c
        value = remote("b", scaled, (s, 3.0))  # b holds a sparse value, which c fetches
        z = await a.rpc_async("c", sparse_stage_of_rref, (value,))
        await autograd.backward(ctx, [(y * z).sum()])
        got_s, got_w = autograd.get_gradients(ctx)[s], grads_on(c, ctx)[W_S]

    def local() -> torch.Tensor:
        return (sparse_stage(s * 1.5 * 2) * 2 * sparse_stage(scaled(s, 3.0))).sum()

    want_s, want_w = local_grads(local, [s, W_S])
    assert same_gradient(got_s, want_s) and close(got_w, want_w)
    assert (await contexts_everywhere(trio)) == [0, 0, 0]


W_E = weights(6, 3, seed=28)  # an embedding table on b


def embed_sparsely(indices: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.embedding(indices, W_E, sparse=True)  # sparse gradient


def project(x: torch.Tensor) -> torch.Tensor:
    return x @ W_E  # dense gradient


async def test_sparse_and_dense_gradients_of_one_leaf_add_up(trio: Agents) -> None:
    a, b, _ = trio
    indices, x = torch.tensor([[0, 2], [2, 5]]), weights(2, 6, seed=29).detach()
    async with autograd.context() as ctx:
        looked_up = await a.rpc_async("b", embed_sparsely, (indices,))
        await autograd.backward(ctx, [looked_up.pow(2).sum()])  # a sparse gradient first
        projected = await a.rpc_async("b", project, (x,))
        await autograd.backward(ctx, [projected.sum()])  # then a dense one
        got = grads_on(b, ctx)[W_E]
    want = local_grads(lambda: embed_sparsely(indices).pow(2).sum() + project(x).sum(), [W_E])
    assert close(got.to_dense(), want[0].to_dense())


def meta_stage(h: torch.Tensor) -> torch.Tensor:
    return h * 2


async def test_tensors_serde_leaves_to_torch_are_recorded_too(trio: Agents) -> None:
    """A tensor serde does not reduce itself (here on the meta device) travels by torch's
    own pickling; it is recorded all the same, and its sender gets its gradient."""
    a = trio[0]
    leaf = torch.empty(3, 2, device="meta", requires_grad=True)
    async with autograd.context() as ctx:
        y = await a.rpc_async("b", meta_stage, (leaf * 3,))
        assert y.device.type == "meta" and y.requires_grad and y.is_leaf
        await autograd.backward(ctx, [y.sum()])
        got = autograd.get_gradients(ctx)[leaf]
    assert got.device.type == "meta" and got.shape == leaf.shape


async def test_metrics_name_steps_by_kind_not_by_rref_or_context(trio: Agents) -> None:
    """A training job makes new RRefs and autograd contexts every step: their calls
    must count in one series per kind, not a new series per RRef or context."""
    a, b, _ = trio
    steps = 4
    for _ in range(steps):
        stage = remote("b", Stage, (9,))
        async with autograd.context() as ctx:
            y = await stage.rpc_async().forward(weights(2, 4, seed=13))
            await autograd.backward(ctx, [(await stage.to_here()).w.sum() + y.sum()])
    made, served = a.metrics.snapshot()["made"], b.metrics.snapshot()["served"]
    for name in ("RRef.forward", "RRef.to_here", "distributed backward"):
        assert made[name]["outcomes"] == {"ok": steps}, name
        assert served[name]["outcomes"] == {"ok": steps}, name
