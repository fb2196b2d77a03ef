"""The backward engine's entry (asyncrpc.autograd.engine._grad) gives exactly what
torch.autograd.grad gives, and refuses gradients of the wrong shape."""

from __future__ import annotations

import pytest
import torch

from asyncrpc.autograd.engine import _grad


def test_same_as_torch_autograd_grad_with_unused_leaves() -> None:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(3, 2, generator=generator, requires_grad=True)
    unused = torch.randn(2, requires_grad=True)
    x = torch.randn(4, 3, generator=generator, requires_grad=True)
    out = torch.tanh(x @ w)
    seed = torch.randn(4, 2, generator=generator)
    got = _grad([(out, seed)], [w, x, unused])
    want = torch.autograd.grad(out, [w, x, unused], seed, retain_graph=True, allow_unused=True)
    assert got[2] is None and want[2] is None
    for g, expected in zip(got[:2], want[:2], strict=True):
        assert g is not None and expected is not None
        torch.testing.assert_close(g, expected, rtol=0, atol=0)
    assert w.grad is None and x.grad is None  # nothing accumulates in .grad


def test_a_gradient_of_the_wrong_shape_is_an_error() -> None:
    w = torch.randn(3, 2, requires_grad=True)
    out = torch.randn(4, 3) @ w
    with pytest.raises(RuntimeError, match="invalid gradient"):
        _grad([(out, torch.ones(5, 2))], [w])
