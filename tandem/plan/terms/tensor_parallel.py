"""Tensor-parallel communication and how much of it the GEMMs next to it hide (``--tp-overlap``).

With sequence parallelism every tensor-parallel all-reduce of a transformer layer is an all-gather in front of a
column-parallel GEMM (QKV, FC1) and a reduce-scatter after a row-parallel GEMM (attention projection, FC2); the
backward pass runs the mirror image (the output gradient gathered in front of the row-parallel layer's dgrad GEMM,
the column-parallel layer's dgrad output reduce-scattered). A ring all-reduce is a reduce-scatter and an
all-gather of the same bytes (NCCL), so each all-reduce call of time c is charged here as an all-gather of c/2 and
a reduce-scatter of c/2. How much of them is exposed, by mode:

- ``none``: all of it (torch's tensor parallel without async TP: torchtitan; Megatron-LM 2021 without
  sequence parallelism). The default, as plain torch runs.
- ``bulk``: in backward the column-parallel layer's dgrad reduce-scatter runs beside its wgrad GEMM, exposed
  max(0, r - G_col); the forward collectives and the backward all-gather stay exposed. Transformer Engine's bulk
  userbuffers overlaps (Megatron's --tp-comm-bulk-dgrad / --tp-comm-bulk-wgrad without the split AG/RS overlaps)
  do this, and so do Transformer Engine's layers WITHOUT userbuffers: with sequence parallelism the
  column-parallel backward launches the dgrad reduce-scatter with async_op=True and runs the wgrad GEMM before
  waiting on it (TE v1.7, transformer_engine/pytorch/module/layernorm_linear.py and linear.py, "Overlap
  dgrad-RS/AR with wgrad"; Megatron-LM's own sequence-parallel linear layers likewise since 2022,
  megatron/core/tensor_parallel/layers.py at 285068c8). So Megatron-core / NeMo on Transformer Engine with
  ub_tp_comm_overlap False (NeMo's GPT-3 175B and Nemotron-4 340B configs) run ``bulk``.
- ``ring``: Transformer Engine's userbuffers overlaps as its initialize_ub lays them out by default and NeMo's
  tp_comm_overlap configures them (nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py;
  NeMo-Framework-Launcher conf/training/tp_overlap/*.yaml): the all-gathers ring-exchanged in tp chunks (qkv/fc1
  fprop, proj/fc2 dgrad: the first GEMM chunk runs on the local shard, so k-1 transfers hide behind k-1 of the k
  chunks, exposed max(0, a - G (k-1)/k)), the forward reduce-scatters pipelined in 4 splits (proj/fc2 fprop: the
  last split is reduced after the last GEMM chunk, exposed max(r/4, r - G x 3/4), dp_overlap.pipelined's rule with the
  GEMM as the window), the dgrad reduce-scatters in bulk (qkv/fc1). torch's async TP (torchtitan's
  enable_async_tensor_parallel: symmetric-memory micro-pipelining of all-gather + matmul and matmul +
  reduce-scatter, torch/_inductor/fx_passes/micro_pipeline_tp.py) splits both into tp chunks, which this rule
  approximates.
Both need the tensor-parallel group inside one NVLink domain (TE's examples/pytorch/comm_gemm_overlap README;
symmetric memory): a tp group across nodes is charged in full whatever the mode.

Not charged: the SM cost of the overlap kernels (ring-exchange uses the copy engines, 1 SM in NeMo's configs; the
"pipeline" method's reduce-scatter takes 16-24 of the H100's 132 SMs from its GEMM, set_sm_margin) and the lower
speed of the tp-times-smaller GEMM chunks; MoE layers' MLP GEMMs are counted as the dense shape's. Against
torchtitan's own async-TP pairs the ring rule hides more than torch did (tests/plan/terms/test_tensor_parallel.py).
"""

from __future__ import annotations

from tandem.plan.terms.collectives import collective, layout, link_name

# Transformer Engine's "pipeline" overlap splits the GEMM + reduce-scatter into 4 (initialize_ub's default
# num_splits, and NeMo's userbuffers configs for proj_fprop / fc2_fprop)
RS_SPLITS = 4


def layer_gemms(g, s, by_tokens: float, linear_rate: float) -> tuple[float, float, float, float]:
    """Forward seconds of one layer's four tensor-parallel GEMMs per micro-batch on one GPU: QKV, projection
    (attention), FC1, FC2 (MLP), each 2 x tokens x in x out / tp FLOPs at the linear layers' rate."""
    d = g.hidden // g.heads
    qkv = 2 * by_tokens * g.hidden * (g.heads + 2 * g.kv_heads) * d / s.tp
    proj = 2 * by_tokens * g.heads * d * g.hidden / s.tp
    fc1 = 2 * by_tokens * g.hidden * g.ffn * (2 if g.gated else 1) / s.tp
    fc2 = 2 * by_tokens * g.ffn * g.hidden / s.tp
    return tuple(f / linear_rate if linear_rate else 0.0 for f in (qkv, proj, fc1, fc2))


def ring_parts(c: float, k: int, gemms: tuple[float, ...]) -> tuple[float, float, float, float]:
    """``ring``: exposed seconds of one all-reduce call ``c`` (an all-gather a and a reduce-scatter of a = c/2) in
    attention's and the MLP's forward, then their backward, as Transformer Engine lays the overlaps out by default
    (transformer_engine/pytorch/module/base.py, initialize_ub): forward, the gather ring-exchanged in ``k`` = tp
    chunks before the column GEMM, max(0, a - G_col (k-1)/k), and the scatter pipelined in 4 splits after the row
    GEMM, max(a/4, a - G_row x 3/4); backward, the output gradient's gather ring-exchanged before the row GEMM's
    dgrad, max(0, a - G_row (k-1)/k), and the column GEMM's dgrad scatter in bulk beside its wgrad GEMM,
    max(0, a - G_col) (a dgrad or wgrad GEMM has its forward GEMM's FLOPs)."""
    a, share = c / 2, (k - 1) / k
    qkv, proj, fc1, fc2 = gemms

    def fwd(col: float, row: float) -> float:
        return max(0.0, a - col * share) + max(a / RS_SPLITS, a - row * (RS_SPLITS - 1) / RS_SPLITS)

    def bwd(col: float, row: float) -> float:
        return max(0.0, a - row * share) + max(0.0, a - col)

    return fwd(qkv, proj), fwd(fc1, fc2), bwd(qkv, proj), bwd(fc1, fc2)


def exposed_per_layer(mode: str, c: float, k: int, gemms: tuple[float, ...], recompute: bool) -> float:
    """Exposed seconds of one layer's tensor-parallel collectives per micro-batch (forward, backward and a full
    recompute's second forward), each all-reduce call ``c`` seconds, ``k`` = tp chunks."""
    fwd_passes = 2 if recompute else 1
    if mode == "none":
        return (2 * fwd_passes + 2) * c
    if mode == "bulk":   # forward exposed; backward: the gather, and the dgrad scatter beside the wgrad GEMM (= G_col)
        qkv, _, fc1, _ = gemms
        return 2 * fwd_passes * c + sum(c / 2 + max(0.0, c / 2 - col) for col in (qkv, fc1))
    fa, fm, ba, bm = ring_parts(c, k, gemms)
    return fwd_passes * (fa + fm) + ba + bm


def tp_op(m, c, t, s, layers: int, mb: int, linear_rate: float) -> dict:
    """CommOp fields of the tensor-parallel collectives of one step on the busiest stage (cost.evaluate):
    all-reduces (AG + RS with sequence parallelism) of a micro-batch's activations; ``linear_rate`` the GEMMs'
    FLOP/s, which --tp-overlap hides them behind."""
    g = m.gpt
    act = s.micro_batch * g.seq // s.cp * g.hidden * t.bytes["act"]
    tpg = layout(s.tp, 1, c.gpus_per_node)
    full = s.recompute == "full"
    per_layer = 4 + (2 if full else 0)   # 2 fwd + 2 bwd (+2 recomputed fwd)
    calls = per_layer * layers * mb
    one, algo = collective("all_reduce", act, 1, tpg, c)   # the algorithm named is the one timed (NVLS, ring, ...)
    gemms = layer_gemms(g, s, s.micro_batch * g.seq / s.cp, linear_rate)
    mode = t.tp_overlap if tpg.nodes == 1 else "none"   # userbuffers / symmetric memory: one NVLink domain
    exposed = exposed_per_layer(mode, one, s.tp, gemms, full) * layers * mb
    rule = "none" if mode == "none" else "tp-" + mode
    return dict(name="tp-activations", collective="all_reduce", bytes=act, calls=calls, group=tpg,
                link=link_name(tpg, c), time_s=one * calls, exposed_s=exposed, rule=rule, algorithm=algo,
                window_s=sum(gemms), detail=(one, gemms, layers, mb, full))
