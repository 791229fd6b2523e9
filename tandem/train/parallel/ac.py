"""Activation checkpointing: none, selective (every N-th block) or full (every block).

A checkpointed block keeps only its input during forward and recomputes its activations
in backward (one extra forward of that block). Applied before data-parallel wrapping so
FSDP's units contain the checkpoint wrappers (the order torchtitan uses).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tandem.train.parallel.fsdp import blocks


def apply_ac(model: nn.Module, mode: str, every: int = 2) -> int:
    """Wrap blocks in place (block i is wrapped when ``full`` or i % every == 0); returns how many."""
    if mode == "none":
        return 0
    targets, i, wrapped = set(blocks(model)), 0, 0
    for parent in _parents(model):
        for name, child in list(parent.named_children()):
            if child in targets:
                if mode == "full" or i % every == 0:
                    parent.register_module(name, checkpoint_wrapper(child, preserve_rng_state=False))
                    wrapped += 1
                i += 1
    return wrapped


def _parents(model: nn.Module):
    lay = getattr(model, "layout", None)
    if lay is not None:   # a decoder (tandem/models/layout.py)
        return [getattr(model, lay.blocks)]
    if isinstance(getattr(model, "layers", None), nn.ModuleDict):   # a user's model laid out the same way
        return [model.layers]
    return [getattr(model, n) for n in ("layer1", "layer2", "layer3", "layer4") if hasattr(model, n)]
