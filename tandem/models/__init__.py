"""Models by name: the built-in ResNets, or any factory given as 'pkg.module:factory'."""

from __future__ import annotations

from torch import nn

from tandem.core.errors import ConfigError
from tandem.core.factory import import_factory
from tandem.core.spec import ModelSpec
from tandem.models.resnet import ResNet, resnet18, resnet34, resnet50

BUILTIN = {"resnet18": 18, "resnet34": 34, "resnet50": 50}
VALID = " | ".join(BUILTIN) + " | gpt | llama | an import path 'pkg.module:factory'"

__all__ = ["ResNet", "resnet18", "resnet34", "resnet50", "build_model", "model_signature",
           "count_params", "BUILTIN"]


def build_model(spec: ModelSpec) -> nn.Module:
    """The model the spec names, on the CPU, freshly initialised (seed the RNG first)."""
    name = spec.name
    if name == "gpt":
        from tandem.models.gpt import gpt
        return gpt(layers=spec.layers, hidden=spec.hidden, heads=spec.heads, kv_heads=spec.kv_heads,
                   ffn=spec.ffn, seq=spec.seq, vocab=spec.vocab, tied=spec.tied)
    if name == "llama":
        from tandem.models.llama import from_spec
        return from_spec(spec)
    if name in BUILTIN:
        return ResNet(depth=BUILTIN[name], width=spec.width, num_classes=spec.num_classes,
                      in_channels=spec.in_channels, small_input=spec.small_input)
    if ":" not in name:
        raise ConfigError("unknown model", field="model.name", value=name,
                          fix=f"use {VALID} (got {name!r})")
    module_name, _, attr = name.partition(":")
    factory = import_factory(name, field="model.name", valid=VALID)
    # The spec's width and small_input are ResNet knobs; a custom factory gets only what
    # every classifier needs.
    try:
        model = factory(num_classes=spec.num_classes, in_channels=spec.in_channels)
    except TypeError as e:
        raise ConfigError(f"factory {name!r} failed ({e})", field="model.name", value=name,
                          fix="make the factory accept num_classes= and in_channels= keywords") from e
    except Exception as e:
        call = f"{attr}(num_classes={spec.num_classes}, in_channels={spec.in_channels})"
        raise ConfigError(f"factory {name!r} raised {type(e).__name__}: {_one_line(e)}", field="model.name",
                          value=name, fix=f"fix the factory; try it by hand: python -c 'import {module_name}; "
                                          f"{module_name}.{call}'") from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"factory {name!r} returned {type(model).__name__}, not an nn.Module",
                          field="model.name", value=name, fix="return a torch.nn.Module from the factory")
    return model


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


def model_signature(model: nn.Module) -> dict[str, list[int]]:
    """Name -> shape of every parameter and buffer: two models load each other's
    checkpoints only if their signatures are equal."""
    sig = {name: list(p.shape) for name, p in model.named_parameters()}
    sig.update({name: list(b.shape) for name, b in model.named_buffers()})
    return sig


def count_params(model: nn.Module) -> int:
    """Number of parameters (shared ones counted once), buffers excluded."""
    return sum(p.numel() for p in model.parameters())
