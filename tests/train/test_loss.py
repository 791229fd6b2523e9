"""model.loss: the three sources of the summed loss agree on the same model and batch."""

import pytest
import torch
import torch.nn.functional as F

from tandem.core.errors import ConfigError
from tandem.train.loss import resolve_loss


class ReturnsLoss(torch.nn.Module):
    """A model in Hugging Face's manner: forward(x, y) returns an object with .loss (a mean)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 5)

    def forward(self, x, y=None):
        logits = self.lin(x)
        if y is None:
            return logits
        mean = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        return type("Out", (), {"loss": mean, "logits": logits})()


def summed(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=-100)


def test_model_returned_mean_becomes_the_sum():
    model = ReturnsLoss()
    x = torch.randn(3, 4, 6)
    y = torch.randint(0, 5, (3, 4))
    y[0, :2] = -100  # not scored
    ref = summed(model(x), y)
    assert torch.allclose(resolve_loss("cross_entropy")(model, x, y), ref)
    assert torch.allclose(resolve_loss("model")(model, x, y), ref)           # mean x 10 scored targets
    assert torch.allclose(resolve_loss(f"{__name__}:summed")(model, x, y), ref)


def test_dict_output_and_bad_path():
    class D(ReturnsLoss):
        def forward(self, x, y=None):
            return {"loss": super().forward(x, y).loss}
    x, y = torch.randn(2, 3, 6), torch.randint(0, 5, (2, 3))
    ref = summed(ReturnsLoss()(x), y)  # same seeded weights
    assert torch.allclose(resolve_loss("model")(D(), x, y), ref)
    with pytest.raises(ConfigError, match="model.loss"):
        resolve_loss("no_such_module_here:fn")
