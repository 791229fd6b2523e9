"""Where a decoder keeps its parts: the one description the strategies that cut a model read.

    model.layout.blocks         # "layers": the ModuleDict of blocks ("0".."L-1")
    model.layout.embeddings     # modules of the first pipeline stage (the first is the token table)
    model.layout.shared         # modules every pipeline stage keeps (the rotary tables)
    model.layout.final          # modules of the last pipeline stage: (norm, head)

Pipeline parallelism (``tandem/train/parallel/pp.py``) keeps each stage's share of these,
tensor parallelism (``tp.py``) turns the block's named linears into column- and row-wise
shards, FSDP and activation checkpointing (``fsdp.py``, ``ac.py``) take the blocks as their
units. A model states its names here instead of the strategies knowing each model's
attribute names. Plain data: no torch, so a description can be read and tested anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderLayout:
    embeddings: tuple[str, ...]              # first stage; row-wise (vocabulary-parallel) under tp
    norm: str = "norm"                       # the final norm (last stage; sequence-parallel under tp)
    head: str = "head"                       # the output layer (last stage): column-wise, logits sharded over
                                             # the vocabulary under loss_parallel
    blocks: str = "layers"                   # an nn.ModuleDict of blocks, keyed "0".."L-1"
    shared: tuple[str, ...] = ()             # on every stage (no parameters: position tables)
    # inside a block (Megatron-LM's split): linears cut by output features (heads, ffn units) ...
    colwise: tuple[str, ...] = ()
    # ... and by input features, their partial sums reduced (or reduce-scattered under sequence parallel)
    rowwise: tuple[str, ...] = ()
    # sequence parallel: norms of the residual stream, sharded along the sequence ...
    norms: tuple[str, ...] = ()
    # ... and the submodules that all-gather that stream back before their column-wise linears
    gathers: tuple[str, ...] = ()
    # submodules whole on every tp rank (a mixture of experts: tandem/train/parallel/expert.py): under
    # sequence parallel they take the gathered stream as a plain tensor and hand back this rank's share of it
    whole: tuple[str, ...] = ()
    # norms over each head's features, applied to (B, T, heads, head_dim): they see only the local heads
    # under tp, so their weight is replicated and its gradient summed over the tp ranks
    head_norms: tuple[str, ...] = ()

    @property
    def final(self) -> tuple[str, ...]:
        return (self.norm, self.head)

    @property
    def token_embedding(self) -> str:
        return self.embeddings[0]
