"""The data and model of the parameter-server examples: scikit-learn's 8x8 digits.

``digits_split()`` loads the 1,797 images of ``sklearn.datasets.load_digits`` (bundled
with scikit-learn, no download) and holds out a fixed, stratified 20% for testing;
``Net`` is a small ConvNet that reaches about 97% held-out accuracy on them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn.functional import log_softmax, max_pool2d, relu

Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def digits_split() -> Split:
    """``(train images, train labels, test images, test labels)``.

    Images are ``(N, 1, 8, 8)`` floats in [0, 1]; the 20% test split is stratified and
    fixed (``random_state=0``), the same on every run.
    """
    from sklearn.datasets import load_digits  # slow to import: only where data is loaded
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    train, test = train_test_split(
        np.arange(len(labels)), test_size=0.2, random_state=0, stratify=digits.target
    )
    return images[train], labels[train], images[test], labels[test]


class Net(nn.Module):
    """A small ConvNet for 8x8 digits; returns log-probabilities (for ``nll_loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = max_pool2d(relu(self.conv1(x)), 2)  # 16 x 4 x 4
        x = max_pool2d(relu(self.conv2(x)), 2)  # 32 x 2 x 2
        return log_softmax(self.fc(torch.flatten(x, 1)), dim=1)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of ``x`` that ``model`` labels correctly."""
    return float((model(x).argmax(dim=1) == y).float().mean())
