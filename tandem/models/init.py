"""Per-tensor initialisation: every parameter and buffer drawn from its own generator.

A tensor's initial value depends only on the seed, its fully-qualified name and its full shape,
never on which tensors were drawn before it. So a rank that holds a shard, or a pipeline
stage that holds a few blocks, computes the same values as one process holding the whole
model, one tensor at a time (``tandem/train/parallel/materialize.py``), and a model built on
the meta device needs no full-size copy anywhere.

A model class states its rules in ``init_tensor(module, name, t, g)``: fill ``t`` (the full
tensor, on the CPU) for parameter or buffer ``name`` of ``module`` from generator ``g``.
Without one, ``default_init`` applies torch's own defaults to the standard layers.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterator

import torch
from torch import nn

# wrappers that activation checkpointing, torch.compile and DDP put into a parameter's name
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")

InitFn = Callable[[nn.Module, str, torch.Tensor, torch.Generator], None]


def canonical(name: str) -> str:
    """The name the tensor has in the plain model (what checkpoints and the init rules see)."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, name): stable across processes, Python versions and runs."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def named_tensors(root: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(canonical name, owning module, attribute, tensor) of every parameter and buffer, each
    shared tensor once (under its first name, as ``named_parameters`` does)."""
    seen: set[int] = set()
    for prefix, module in root.named_modules():
        for attr, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield canonical(f"{prefix}.{attr}" if prefix else attr), module, attr, t


def full_value(root: nn.Module, module: nn.Module, name: str, shape, dtype, seed: int) -> torch.Tensor:
    """The full initial value of one tensor, on the CPU."""
    t = torch.empty(shape, dtype=dtype)
    rule: InitFn = getattr(root, "init_tensor", default_init)
    with torch.no_grad():
        rule(module, name, t, generator(seed, name))
    return t


def init_weights(root: nn.Module, seed: int | None = None) -> None:
    """Initialise every materialised tensor of ``root`` in place (meta tensors are skipped: the
    model is being built on the meta device and ``materialize`` fills it later). ``seed``:
    default ``torch.initial_seed()``, the seed of the last ``torch.manual_seed``."""
    seed = torch.initial_seed() if seed is None else seed
    with torch.no_grad():
        for name, module, _, t in named_tensors(root):
            if not t.is_meta:
                t.copy_(full_value(root, module, name, t.shape, t.dtype, seed))


def default_init(module: nn.Module, name: str, t: torch.Tensor, g: torch.Generator) -> None:
    """torch's own initialisation of the standard layers, from generator ``g``."""
    attr = name.rsplit(".", 1)[-1]
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        if attr == "weight":  # Linear.reset_parameters / _ConvNd.reset_parameters
            nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
        else:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(module.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            nn.init.uniform_(t, -bound, bound, generator=g)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(t, generator=g)
        if module.padding_idx is not None:
            t[module.padding_idx].fill_(0)
    elif isinstance(module, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)):
        # weight and running_var start at 1; bias, running_mean and num_batches_tracked at 0
        t.fill_(1 if attr in ("weight", "running_var") else 0)
    else:
        raise TypeError(f"no initialisation rule for {name} of {type(module).__name__}: give the model an "
                        f"init_tensor(module, name, tensor, generator) method")
