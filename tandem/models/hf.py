"""Hugging Face checkpoints into tandem's own modules, and tandem's tensors into Hugging Face's layout.

    model = tandem.models.hf.load("DIR")               # tandem's Llama / GPT holding DIR's weights (CPU)
    w = weights_for(spec.model)                        # per-tensor reader the materializer fills shards from
    t = w.value(root, module, "layers.0.attn.wq.weight", shape, dtype, seed)
    hf_tensor = to_hf(rule, [tandem tensors...])       # the export's direction (tandem/export/hf.py)

The adapters themselves (which HF tensor holds which tandem tensor, and how) are data in
``tandem/core/hf.py``; this file applies their ops to tensors. A weight is read with safetensors'
``safe_open``, one tensor at a time, so a rank that holds a shard reads each full tensor once, keeps
its part (``tandem/train/parallel/materialize.py``) and drops the rest: the training strategies
(ddp, zero1-3, hsdp, tp, pp) start from the checkpoint exactly as they start from the seeded init.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from tandem.core import hf as adapters
from tandem.core.errors import CheckpointError, ConfigError
from tandem.core.spec import ModelSpec
from tandem.models.init import full_value, named_tensors


def _kv_rows(t: torch.Tensor, repeat: int, head_dim: int) -> torch.Tensor:
    """Each key/value head's rows repeated ``repeat`` times (tandem's repeat_interleave over heads)."""
    if repeat == 1:
        return t
    shape = t.shape
    return t.reshape(-1, head_dim, *shape[1:]).repeat_interleave(repeat, dim=0).reshape(-1, *shape[1:])


def to_hf(rule: adapters.Rule, parts: list[torch.Tensor], head_dim: int = 0) -> torch.Tensor:
    """The Hugging Face tensor of ``rule`` from its tandem tensors (in ``rule.tandem``'s order)."""
    if rule.op == "copy":
        return parts[0]
    if rule.op == "transpose":
        return parts[0].t().contiguous()
    if rule.op == "expert":   # one expert's slice of the stacked (experts, in, out) weight, as nn.Linear's (out, in)
        return parts[0][rule.expert].t().contiguous()
    q, k, v = parts
    k, v = _kv_rows(k, rule.repeat, head_dim), _kv_rows(v, rule.repeat, head_dim)
    fused = torch.cat([q, k, v], dim=0)
    return fused.t().contiguous() if rule.op == "qkv" else fused


def to_tandem(rule: adapters.Rule, t: torch.Tensor, index: int) -> torch.Tensor:
    """Tandem tensor ``rule.tandem[index]`` from the Hugging Face tensor ``t`` (an import has no grouped
    k/v heads to undo: GPT-2 checkpoints are multi-head)."""
    if rule.op == "copy":
        return t
    if rule.op == "transpose":
        return t.t().contiguous()
    if rule.op == "expert":
        raise ValueError("an expert's weight is one slice of its tandem tensor: Weights.tensor stacks them")
    if rule.repeat != 1:
        raise ValueError("a fused q/k/v with repeated k/v heads is export-only")
    fused = t.t() if rule.op == "qkv" else t
    return fused.chunk(3, dim=0)[index].contiguous()


def _model_dict(m: ModelSpec | dict) -> dict:
    return dataclasses.asdict(m) if isinstance(m, ModelSpec) else dict(m)


def rules_for(m: ModelSpec | dict) -> list[adapters.Rule]:
    d = _model_dict(m)
    return adapters.for_model(d).rules(d)


class Weights:
    """The Hugging Face folder's tensors by tandem name, read one at a time (safetensors ``safe_open``)."""

    def __init__(self, folder: Path, rules: list[adapters.Rule]):
        self.folder = Path(folder)
        adapters.check_folder(self.folder, rules)    # files there, every tensor with the config's shape
        self.where = adapters.weight_map(self.folder)
        self.by_name = {n: (r, i) for r in rules for i, n in enumerate(r.tandem)}
        # a stacked expert weight (Mixtral): its HF tensors, expert 0 first
        self.stacks: dict[str, list[adapters.Rule]] = {}
        for r in rules:
            if r.op == "expert":
                self.stacks.setdefault(r.tandem[0], []).append(r)
        for rs in self.stacks.values():
            rs.sort(key=lambda r: r.expert)
        _check_sha256(self.folder)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def read_hf(self, hf_name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.folder / self.where[hf_name]
        try:
            with safe_open(str(f), framework="pt") as st:
                return st.get_tensor(hf_name)
        except OSError as e:
            raise CheckpointError(f"cannot read {hf_name} from {f.name} ({type(e).__name__}: {e})",
                                  field="model.name", value=f"hf:{self.folder}",
                                  fix="copy the folder again from its source") from e

    def tensor(self, name: str) -> torch.Tensor:
        if name in self.stacks:   # (experts, in, out): each expert's (out, in) Linear weight transposed
            return torch.stack([self.read_hf(r.hf).t() for r in self.stacks[name]])
        rule, i = self.by_name[name]
        return to_tandem(rule, self.read_hf(rule.hf), i)

    def value(self, root: nn.Module, module: nn.Module, name: str, shape, dtype, seed: int) -> torch.Tensor:
        """The full value of tandem tensor ``name``: the checkpoint's, or (a buffer the checkpoint does not
        hold: the rotary table) the model's own initial value."""
        if name not in self.by_name:
            return full_value(root, module, name, shape, dtype, seed)
        t = self.tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{name} from {self.by_name[name][0].hf} is {list(t.shape)}, the model's is "
                                  f"{list(shape)}", field="model.name", value=f"hf:{self.folder}",
                                  fix="give the config.json these weights were saved with")
        return t.to(dtype)


def _check_sha256(folder: Path) -> None:
    """Files whose sha256 a manifest.json there records (a tandem export) must match it."""
    man = folder / "manifest.json"
    if not man.is_file():
        return
    try:
        files = json.loads(man.read_text()).get("files", {})
    except (json.JSONDecodeError, AttributeError):
        return
    for rel, want in files.items():
        if not rel.endswith(".safetensors") or not isinstance(want, dict) or "sha256" not in want:
            continue
        p = folder / rel
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        if h.hexdigest() != want["sha256"]:
            raise ConfigError(f"{rel} differs from its sha256 in manifest.json", field="model.name",
                              value=f"hf:{folder}", fix="copy the folder again from its source")


def weights_for(m: ModelSpec) -> Weights | None:
    """The reader of the spec's Hugging Face folder (``model.name = 'hf:DIR'``), or None."""
    m = resolve_spec(m)
    if not m.hf:
        return None
    return Weights(Path(m.hf["path"]), rules_for(m))


def resolve_spec(m: ModelSpec) -> ModelSpec:
    """A ModelSpec named ``hf:DIR`` as the model it stands for (what load_spec does to a spec file)."""
    if not adapters.is_hf(m.name):
        return m
    defaults = ModelSpec()
    given = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)
             if f.name == "name" or getattr(m, f.name) != getattr(defaults, f.name)}
    return ModelSpec(**adapters.resolve(given))


def load_into(model: nn.Module, weights: Weights) -> nn.Module:
    """Copy the checkpoint into a model that holds storage (tied tensors once)."""
    with torch.no_grad():
        for name, module, _, t in named_tensors(model):
            if name in weights:
                t.copy_(weights.value(model, module, name, t.shape, t.dtype, 0))
    return model


def load(folder, **model_fields) -> nn.Module:
    """Tandem's own model holding a Hugging Face folder's weights, on the CPU, in eval mode.
    ``model_fields``: ModelSpec fields besides the shape (e.g. ``seq=64`` for a Llama)."""
    m = resolve_spec(ModelSpec(name=f"hf:{folder}", **model_fields))
    if m.name == "gpt":
        from tandem.models.gpt import gpt

        model = gpt(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads, ffn=m.ffn, seq=m.seq,
                    vocab=m.vocab, tied=m.tied, gelu=m.gelu)
    else:
        from tandem.models.llama import from_spec

        model = from_spec(m)
    return load_into(model, weights_for(m)).eval()
