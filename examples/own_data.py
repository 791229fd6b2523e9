"""Your own data set and model, next to their job spec (examples/own_data.toml).

A table, not images: scikit-learn's bundled breast-cancer measurements (569 patients, 30 numbers
each, benign or malignant), held out by a seeded split and standardised by the train rows only.
tandem imports ``datasets`` and ``mlp`` from this file (``data.name`` and ``model.name``), calls them
on every rank with the keywords they accept, and trains, shards, resumes and evaluates the sets
as it does its own.
"""

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from tandem.core.extras import require


class Table(Dataset):
    """Map-style: a length and item i, an (x, y) pair of tensors."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def datasets(seed: int = 0, held_out: float = 0.2):
    """(train, held_out): the same on every rank, a pure function of the seed."""
    require("examples", "examples/own_data.py")  # scikit-learn: one line naming the extra when absent
    from sklearn.datasets import load_breast_cancer

    d = load_breast_cancer()
    x, y = d.data.astype(np.float32), d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    k = round(len(y) * held_out)
    held, train = perm[:k], perm[k:]
    mean, std = x[train].mean(0), x[train].std(0) + 1e-6  # statistics of the train rows only
    x = (x - mean) / std
    return Table(x[train], y[train]), (Table(x[held], y[held]) if k else None)


def mlp(num_classes: int = 2, in_channels: int = 30) -> nn.Module:
    """``in_channels``: the number of features of a row (model.in_channels in the spec)."""
    return nn.Sequential(nn.Linear(in_channels, 64), nn.ReLU(), nn.Linear(64, num_classes))


def weighted_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Your own loss (``model.loss = "examples.own_data:weighted_loss"``): a missed malignant case
    (label 0) costs twice a false alarm. The *sum* over the micro-batch: tandem divides by the
    step's samples, so the gradient is the mean over the step whatever the split into ranks."""
    weight = torch.tensor([2.0, 1.0], device=output.device)
    return nn.functional.cross_entropy(output.float(), target, weight=weight, reduction="sum")
