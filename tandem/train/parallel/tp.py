"""Tensor parallelism for the decoders (GPT, Llama) with DTensor's ``parallelize_module`` (Megatron-LM split).

Per block: q/k/v and the MLP's first matrix (Llama: its gate and up matrices) column-wise
(each tp rank owns heads/tp heads and ffn/tp hidden units), the attention output and the
MLP's second matrix row-wise (their partial sums are all-reduced, or reduce-scattered along
the sequence with sequence parallelism); Llama's qk-norm weights replicated, their gradients
summed over the tp ranks. The module names come from the model's ``layout``.
Embeddings are vocabulary-parallel (row-wise on the table); the output layer is column-wise
with its logits left sharded over the vocabulary so the loss runs in place (``loss_parallel``).
With ``sequence_parallel`` the norms and the residual stream are sharded along the sequence
(Korthikanti et al. 2022): all-reduce becomes reduce-scatter + all-gather, same bytes, 1/tp
of the activations. A mixture of experts stays whole on every tp rank (the layout's ``whole``): under
sequence parallel it takes the gathered sequence and keeps this rank's share of its output.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> nn.Module:
    """The plan from the model's ``layout`` (``tandem/models/layout.py``): the same for every decoder."""
    lay, sp = model.layout, sequence_parallel
    stream = Shard(1) if sp else Replicate()        # layout of the residual stream between blocks
    emb, head = getattr(model, lay.token_embedding), getattr(model, lay.head)
    tied = head is not None and emb is not None and head.weight is emb.weight
    top: dict = {}
    if emb is not None:
        for name in lay.embeddings:
            top[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if getattr(model, lay.norm) is not None and sp:
        top[lay.norm] = SequenceParallel()
    if head is not None:
        top[lay.head] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:  # both became Shard(0) on the vocabulary: share the one DTensor again
        getattr(model, lay.head).weight = getattr(model, lay.token_embedding).weight
    plan = {name: ColwiseParallel() for name in lay.colwise}
    plan.update({name: RowwiseParallel(output_layouts=stream) for name in lay.rowwise})
    # (B, T, heads, head_dim) with the heads split: a replicated weight, its gradient summed over tp
    plan.update({name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in lay.head_norms})
    if sp:
        plan.update({name: SequenceParallel() for name in lay.norms})
        plan.update({name: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                     for name in lay.gathers})
        # a module whole on every tp rank (an MoE) sees the whole sequence, as without sp, so its routing and
        # capacity are one process's; its output, the same on every tp rank, is cut back to this rank's share
        # (backward: the shares' gradients all-gathered, the same on every tp rank again, as the MoE expects)
        plan.update({name: PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
            for name in lay.whole})
    for block in getattr(model, lay.blocks).values():
        parallelize_module(block, tp_mesh, plan)
    return model
