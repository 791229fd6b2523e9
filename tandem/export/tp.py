"""How a tensor-parallel inference rank's slice of each weight is cut: tandem's tp plan, offline.

The same Megatron-LM split as training (tandem/train/parallel/tp.py): per block, q/k/v and the
MLP's first matrix column-wise (``Shard(0)`` of the weight and bias: rank r owns heads/tp heads
and ffn/tp hidden units), the attention output and the MLP's second matrix row-wise (``Shard(1)``
of the weight; the bias is replicated, added once after the all-reduce); the token and position
embeddings vocabulary-parallel (``Shard(0)`` of the table), the output layer column-wise over the
vocabulary (``Shard(0)``); the norms replicated. Slices follow DTensor's ``Shard`` (torch.chunk:
ceil-sized pieces, the last ones shorter), so rank r's slice equals ``full_tensor()``'s piece r.
"""

from __future__ import annotations

import torch

from tandem.core.errors import ConfigError

COLUMN = ("attn.wq.weight", "attn.wq.bias", "attn.wk.weight", "attn.wk.bias", "attn.wv.weight", "attn.wv.bias",
          "mlp.w1.weight", "mlp.w1.bias")
ROW = ("attn.wo.weight", "mlp.w2.weight")
VOCAB = ("tok_emb.weight", "pos_emb.weight", "head.weight")


def shard_dim(name: str) -> int | None:
    """The dimension ``name`` is split along under tp, or None (replicated)."""
    if name in VOCAB:
        return 0
    if name.startswith("layers."):
        tail = name.split(".", 2)[2]
        if tail in COLUMN:
            return 0
        if tail in ROW:
            return 1
    return None


def check_degree(model_spec: dict, tp: int) -> None:
    """Refuse a degree the model cannot be split into (as `tandem train --parallel.tp` would)."""
    if tp < 1:
        raise ConfigError(f"must be at least 1, got {tp}", field="--tp", value=tp, fix="give 1, 2, 4, ...")
    if tp == 1:
        return
    if model_spec.get("name") != "gpt":
        raise ConfigError(f"tensor-parallel shards need the gpt model; model {model_spec.get('name')!r} has no "
                          f"tp plan", field="--tp", value=tp, fix="export without --tp")
    heads = model_spec["heads"]
    kv = model_spec.get("kv_heads") or heads
    ffn = model_spec.get("ffn") or 4 * model_spec["hidden"]
    for what, n in (("heads", heads), ("kv_heads", kv), ("ffn", ffn)):
        if n % tp:
            raise ConfigError(f"{what} {n} is not divisible by tp {tp} ({n} % {tp} = {n % tp})", field="--tp",
                              value=tp, fix=f"choose a tp that divides heads {heads} and kv_heads {kv}")


def slice_shape(shape: tuple[int, ...], dim: int | None, tp: int, rank: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(shape)
    size = -(-shape[dim] // tp)                      # torch.chunk's piece size
    lo = min(rank * size, shape[dim])
    hi = min(lo + size, shape[dim])
    return tuple(hi - lo if i == dim else s for i, s in enumerate(shape))


def cut(t: torch.Tensor, dim: int | None, tp: int, rank: int) -> torch.Tensor:
    if dim is None:
        return t
    size = -(-t.shape[dim] // tp)
    lo = min(rank * size, t.shape[dim])
    return t.narrow(dim, lo, min(size, t.shape[dim] - lo))
