"""A model of one's own whose input is token ids, not an image (tests/serve/test_serve_own_model.py).

``datasets``: sequences of 6 int64 ids under ``vocab``; the label says whether the first id is above the
last. ``bag``: embedding -> mean -> ``depth`` layers of ``width``, sized by the spec's [model] section:
``vocab`` is a field tandem knows, ``width`` and ``depth`` keys only this factory does.
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def datasets(seed: int = 0, held_out: float = 0.2, vocab: int = 16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 12, (160, 6), generator=g)
    y = (x[:, 0] > x[:, -1]).long()
    k = round(len(y) * held_out)
    return TensorDataset(x[k:], y[k:]), (TensorDataset(x[:k], y[:k]) if k else None)


class Bag(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, num_classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(width, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids).mean(1)))


def bag(num_classes: int, vocab: int, width: int = 16, depth: int = 1) -> nn.Module:
    return Bag(vocab, width, depth, num_classes)


def broken(num_classes: int, width: int = 8) -> nn.Module:
    """A factory whose body raises TypeError (not a keyword problem): the error must say so, and where."""
    return nn.Linear(width, num_classes, bias="yes", nonsense=1)
