"""Stand-ins for what the tutorials need and a CI machine lacks: torchvision's MNIST, and
fixed ports.

Each has the interface the tutorial programs use, so their code stays as written:

* ``datasets.MNIST`` and ``transforms``: a small synthetic, learnable 10-class set of
  28x28 images (each class lights its own patch), in place of the 60,000-image download.
* :func:`port`: the tutorials hard-code ports 29500/29501; the test passes free ones in
  ``TUTORIAL_PORTS`` so runs in parallel do not collide.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch


def port(index: int, default: str) -> str:
    """The ``index``-th port of ``TUTORIAL_PORTS`` (comma-separated), else ``default``."""
    ports = os.environ.get("TUTORIAL_PORTS")
    return ports.split(",")[index] if ports else default


# ---------------------------------------------------------------- MNIST


class _Compose:
    def __init__(self, steps: list[Callable[[Any], Any]]) -> None:
        self.steps = steps

    def __call__(self, x: Any) -> Any:
        for step in self.steps:
            x = step(x)
        return x


class _ToTensor:
    """A 28x28 uint8 image to a 1x28x28 float tensor in [0, 1], as torchvision's."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.to(torch.float32).div(255).unsqueeze(0)


class _Normalize:
    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.mean, self.std = mean[0], std[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class _MNIST(torch.utils.data.Dataset[tuple[Any, int]]):
    """A synthetic MNIST of the same interface and shapes: digit ``k`` is a bright 7x7
    patch at its own place on a noisy 28x28 background (640 training, 320 test images)."""

    def __init__(
        self,
        root: str,
        train: bool = True,
        download: bool = False,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        del root, download  # nothing to download
        generator = torch.Generator().manual_seed(0 if train else 1)
        count = 640 if train else 320
        self.targets = torch.randint(0, 10, (count,), generator=generator)
        images = torch.randint(0, 96, (count, 28, 28), generator=generator, dtype=torch.uint8)
        for i, digit in enumerate(self.targets.tolist()):
            row, col = 3 + 8 * (digit // 4), 3 + 8 * (digit % 4)
            images[i, row : row + 7, col : col + 7] = 255
        self.data = images
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image: Any = self.data[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


datasets = SimpleNamespace(MNIST=_MNIST)
transforms = SimpleNamespace(Compose=_Compose, ToTensor=_ToTensor, Normalize=_Normalize)
