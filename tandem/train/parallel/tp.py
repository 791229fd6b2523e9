"""Tensor parallelism for the GPT decoder with DTensor's ``parallelize_module`` (Megatron-LM split).

Per block: q/k/v and the MLP's first matrix column-wise (each tp rank owns heads/tp heads and
ffn/tp hidden units), the attention output and the MLP's second matrix row-wise (their partial
sums are all-reduced, or reduce-scattered along the sequence with sequence parallelism).
Embeddings are vocabulary-parallel (row-wise on the table); the output layer is column-wise
with its logits left sharded over the vocabulary so the loss runs in place (``loss_parallel``).
With ``sequence_parallel`` the norms and the residual stream are sharded along the sequence
(Korthikanti et al. 2022): all-reduce becomes reduce-scatter + all-gather, same bytes, 1/tp
of the activations.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> nn.Module:
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()        # layout of the residual stream between blocks
    tied = model.head is not None and model.tok_emb is not None and model.head.weight is model.tok_emb.weight
    top: dict = {}
    if model.tok_emb is not None:
        top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        top["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.head is not None:
        top["head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:  # both became Shard(0) on the vocabulary: share the one DTensor again
        model.head.weight = model.tok_emb.weight
    for block in model.layers.values():
        plan = {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=stream),
            "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=stream),
        }
        if sp:
            plan.update({
                "ln1": SequenceParallel(), "ln2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)
    return model
