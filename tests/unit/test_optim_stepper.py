"""Which way a DistributedOptimizer's local optimizer steps: torch's functional twin of
its class where there is one for the arguments, else the class itself; both must
leave parameters exactly as the class's own step does."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from asyncrpc.optim import _stepper


def fresh() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(4, 3, generator=generator, requires_grad=True) for _ in range(2)]


def grads() -> list[torch.Tensor | None]:
    generator = torch.Generator().manual_seed(4)
    return [torch.randn(4, 3, generator=generator), None]  # the second got no gradient


@pytest.mark.parametrize(
    ("cls", "args", "kwargs", "twin"),
    [
        (torch.optim.SGD, (), {"lr": 0.1, "momentum": 0.9}, True),
        (torch.optim.Adam, (), {"lr": 0.01, "betas": (0.8, 0.9)}, True),
        (torch.optim.SGD, (0.1,), {}, False),
        (torch.optim.SGD, (), {"lr": 0.1, "differentiable": False}, False),
        (torch.optim.ASGD, (), {"lr": 0.1}, False),
    ],
)
def test_steps_like_the_class(
    cls: type[torch.optim.Optimizer], args: tuple[Any, ...], kwargs: dict[str, Any], twin: bool
) -> None:
    params, reference = fresh(), fresh()
    step = _stepper(cls, params, args, kwargs)
    assert (getattr(step, "__name__", "") != "step_with_grads") == twin
    optimizer = cls(reference, *args, **kwargs)
    for _ in range(3):
        step(grads())
        for param, grad in zip(reference, grads(), strict=True):
            param.grad = grad
        optimizer.step()
    for got, want in zip(params, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.grad is None  # nothing is left in .grad


def test_the_twins_deprecation_warning_is_not_shown() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _stepper(torch.optim.SGD, fresh(), (), {"lr": 0.1})
        warnings.warn("other warnings still are", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["other warnings still are"]
