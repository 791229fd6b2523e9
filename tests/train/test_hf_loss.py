"""model.loss = "model" on Hugging Face causal LMs: the keywords they understand, and labels such that
their own loss is tandem's next-token loss (tokens targets come already shifted, y[t] = x[t + 1])."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from tandem.train.loss import call_style, hf_labels, resolve_loss, scored  # noqa: E402
from train.hf_lm import tiny_llama  # noqa: E402


def window(vocab=64, batch=3, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return w[:, :-1], w[:, 1:]


class NamesHFKeywords(torch.nn.Module):
    """A model of one's own written in Hugging Face's manner (forward(input_ids, labels), labels shifted
    inside), without transformers' shift_labels: the "hf" call."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids=None, labels=None):
        return self.inner(input_ids=input_ids, labels=labels)


def test_transformers_model_scores_every_target_as_cross_entropy_does():
    torch.manual_seed(0)
    model = tiny_llama(vocab=64, hidden=32, layers=1, heads=4, seq=16).eval()
    x, y = window()
    assert call_style(model) == "hf_shift"
    with torch.no_grad():
        mine = resolve_loss("model")(model, x, y)
        builtin = resolve_loss("cross_entropy")(model, x, y)  # the HF output's .logits, tandem's summed loss
        direct = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten(), reduction="sum")
    assert torch.allclose(mine, direct, rtol=1e-5, atol=1e-5)
    assert torch.allclose(builtin, direct, rtol=1e-5, atol=1e-5)


def test_hf_style_model_gets_labels_aligned_with_its_input():
    torch.manual_seed(0)
    inner = tiny_llama(vocab=64, hidden=32, layers=1, heads=4, seq=16).eval()
    model = NamesHFKeywords(inner)
    x, y = window()
    assert call_style(model) == "hf"
    lab = hf_labels(y)
    assert (lab[:, 0] == -100).all() and torch.equal(lab[:, 1:], y[:, :-1])
    with torch.no_grad():
        mine = resolve_loss("model")(model, x, y)
        # transformers itself, in its own convention (labels = input_ids): the first T-1 targets
        hf_mean = inner(input_ids=x, labels=x).loss
    assert scored(lab) == 3 * 11
    assert torch.allclose(mine, hf_mean * 33, rtol=1e-5, atol=1e-5)


def test_positional_forward_keeps_model_x_y():
    class Positional(torch.nn.Module):
        def forward(self, x, y):
            self.got = (x, y)
            return {"loss": torch.tensor(2.0)}

    m = Positional()
    x, y = window()
    assert call_style(m) == "positional"
    assert float(resolve_loss("model")(m, x, y)) == 2.0 * y.numel()
    assert m.got[0] is x and m.got[1] is y


def test_class_labels_go_in_unshifted():
    class Classifier(torch.nn.Module):
        def forward(self, input_ids=None, labels=None):
            self.labels = labels
            return {"loss": torch.tensor(0.5)}

    m = Classifier()
    y = torch.tensor([1, 0, 3])
    assert float(resolve_loss("model")(m, torch.zeros(3, 4), y)) == 1.5
    assert m.labels is y
