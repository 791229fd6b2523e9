"""Measure a model on the meta device: no memory allocated, no weights initialised for real.

- parameters: counted exactly (shared parameters once);
- FLOPs per sample: torch.utils.flop_counter.FlopCounterMode over forward (and backward,
  reported for reference); the planner uses 3 x forward, the usual training estimate;
- activations per sample: bytes of the tensors autograd saves for backward
  (torch.autograd.graph.saved_tensors_hooks), each storage counted once, parameters
  excluded. This is the activation memory of the training step, without allocator
  fragmentation and transient workspaces.
Runs on the CPU in about a second for a ResNet-50.
"""

from __future__ import annotations

from tandem.core.errors import ConfigError
from tandem.plan.inputs.model import ModelStats

BATCH = 2


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """'3,224,224' -> image input of that shape; 'tokens:2048' -> token ids of that length."""
    try:
        if text.startswith("tokens:"):
            return "tokens", (int(text.split(":", 1)[1]),)
        shape = tuple(int(x) for x in text.split(","))
        if not shape or min(shape) <= 0:
            raise ValueError
        return "float", shape
    except ValueError:
        raise ConfigError("bad input shape", field="input-shape", value=text,
                          fix="write C,H,W such as 3,224,224, or tokens:SEQ") from None


def build(path: str, kwargs: dict | None = None):
    # torch (and the model factories, which import it) only when a model is measured: a heavy import
    import torch
    from torch import nn

    from tandem.core.factory import import_factory

    factory = import_factory(path, field="model", valid="pkg.module:factory")
    with torch.device("meta"):
        model = factory(**(kwargs or {}))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{path!r} returned {type(model).__name__}, not an nn.Module", field="model",
                          value=path, fix="return a torch.nn.Module from the factory")
    return model


def measure_module(model, input_shape: str = "3,224,224", name: str = "model") -> ModelStats:
    # torch only when a model is measured: a heavy import the arithmetic never needs
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    kind, shape = parse_input_shape(input_shape)
    model = model.to("meta")
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    n = sum(p.numel() for p in model.parameters())
    largest = max((sum(p.numel() for p in mod.parameters(recurse=False)) for mod in model.modules()), default=0)
    if kind == "tokens":
        x = torch.zeros((BATCH, *shape), dtype=torch.long, device="meta")
    else:
        x = torch.empty((BATCH, *shape), device="meta")
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            saved[st._cdata] = st.nbytes()
        return t

    try:
        with FlopCounterMode(display=False) as fc:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = model(x)
            fwd = fc.get_total_flops()
            out = y if isinstance(y, torch.Tensor) else (y[0] if isinstance(y, (tuple, list)) else y.logits)
            out.float().sum().backward()
    except Exception as e:  # the model's own error, on meta tensors
        raise ConfigError(f"could not run the model on the meta device ({type(e).__name__}: {e})",
                          field="model", value=name, fix="check --input-shape, or give --params/--layers") from None
    if fwd == 0:
        raise ConfigError("measured 0 FLOPs", field="model", value=name, fix="check --input-shape")
    act = sum(saved.values()) / BATCH
    return ModelStats(name, "cnn" if kind == "float" else "net", n, fwd / BATCH, act, source="measured on meta device (FlopCounterMode, "
                      "saved_tensors_hooks)", largest_layer_params=largest)


def measure(path: str, input_shape: str = "3,224,224", kwargs: dict | None = None) -> ModelStats:
    return measure_module(build(path, kwargs), input_shape, name=path)
