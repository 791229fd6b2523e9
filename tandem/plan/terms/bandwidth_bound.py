"""Bandwidth-bound kernels (memory-bound work outside the GEMMs): a transformer's elementwise and normalisation kernels, its loss over the
vocabulary, and the optimizer step (AdamW, SGD), timed as bytes moved at the GPU's achievable memory bandwidth.

A layer norm, a residual add, GeLU, SwiGLU or a rotary embedding does a few FLOPs per element it reads, far below
any GPU's ops:byte ratio, so it runs at the memory bandwidth whatever its FLOP count (NVIDIA, *GPU Performance
Background User's Guide*, "Memory-limited layers": element-wise operations, normalizations and reductions). Each
op's traffic is counted per token the way Korthikanti et al. 2022 (§4.1) count activation bytes: per layer, per
element of the hidden (h), MLP (ffn) or key/query (h + kv) width; forward reads the op's inputs and writes its
output; backward reads the output gradient and the saved inputs and writes the input gradients. Counts are in
element passes at the activation width (2 B in 16-bit training); an fp32 upcast counts 2 per element.

How many passes depends on what the framework fuses (``Training.kernels``):

- ``fused`` (Megatron-LM / NeMo / Transformer Engine / Apex: the default, since the planner's other defaults are
  Megatron's): one kernel per norm (apex / TE fused LayerNorm, RMSNorm), fused bias-dropout-add for each residual,
  fused bias-GeLU or SwiGLU, fused rotary embedding, a fused cross-entropy (one read of the logits forward, a read
  and a write backward), a fused Adam step (one pass over the optimizer states).
- ``compiled`` (torch.compile / TorchInductor: pointwise ops and reductions of a chain become one kernel, Ansel et
  al., *PyTorch 2*, ASPLOS 2024, §5): as ``fused``, the residual add folded into the next norm; PyTorch's default
  foreach AdamW (the step is not compiled).
- ``eager`` (PyTorch eager mode, one kernel per op): RMSNorm composed of pow, mean, rsqrt and two multiplies;
  LayerNorm's native kernel plus its separate weight-gradient kernel; SwiGLU as silu then a multiply; rotary
  embedding through fp32 complex numbers (Meta's Llama reference: cast, complex multiply, cast back);
  ``F.cross_entropy`` in fp32 under autocast (cast, log_softmax, nll, and their backward); foreach AdamW.

Fused attention (FlashAttention) keeps softmax, dropout and masking inside its kernel; unfused attention's own
cost is efficiency.py's ``unfused`` factor. Bias adds run in the GEMM epilogue (cuBLASLt) and are not counted;
dropout is taken as off (the published runs checked here train without it, or fuse it into the residual add).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Achievable share of the datasheet memory bandwidth for streaming kernels. A STREAM triad (a = b + x*c, the
# standard sustained-bandwidth kernel) timed with CUDA events on an H100 SXM reaches 3,089 of its 3,350 GB/s
# (0.92; a published benchmark log, quoted in docs/plan.md); elementwise kernels with a reduction (norms) and
# short rows reach less, so 0.9 is taken. No NVIDIA figure per GPU was found.
BANDWIDTH_SHARE = 0.9
BANDWIDTH_SOURCE = "0.9 of the datasheet memory bandwidth (a STREAM triad reaches 0.92 of an H100 SXM's)"

# Optimizer step, bytes per parameter this GPU updates (mixed-precision AdamW: fp32 master weights, fp32 gradient,
# two fp32 moments). fused (apex FusedAdam, torch fused=True, Megatron's distributed optimizer): one pass reads
# weight, gradient, m and v (16 B) and writes weight, m and v (12 B): 28 B. foreach (torch.optim.AdamW's default on
# CUDA): its _multi_tensor_adamw makes eight passes (lerp of m 12 B, mul of v 8, addcmul of v 12, weight decay 8,
# sqrt 8, div 8, add eps 8, addcdiv of the weight 16): 80 B. Either way the 16-bit working copy is written from
# the fp32 weights (read 4, write 2: 6 B; FSDP casts at its all-gather, Megatron copies after the step); gradient
# clipping by norm reads every gradient for the norm and scales it (4 + 8 = 12 B; torch.nn.utils.clip_grad_norm_,
# Megatron's multi_tensor_l2norm + multi_tensor_scale). PyTorch's docs (torch.optim, "Algorithms"): foreach and
# fused are faster than the for-loop; fused is "theoretically fastest with both vertical and horizontal fusion".
ADAM_BYTES = {"fused": 28, "foreach": 80}
# SGD, bytes per parameter (fp32 weight, gradient and momentum buffer; torch 2.13 torch/optim/sgd.py). foreach
# (_multi_tensor_sgd): the update _foreach_add_(params, grads, alpha=-lr) reads weight and gradient and writes the
# weight, 12 B; momentum adds _foreach_mul_(bufs) (8 B) and _foreach_add_(bufs, grads) (12 B) before it: 32 B.
# fused (_fused_sgd: one multi_tensor_apply kernel, aten/src/ATen/native/cuda/FusedSgdKernel.cu, reading weight,
# gradient and buffer and storing weight and buffer): 12 B, 20 B with momentum (apex's multi_tensor_sgd_kernel.cu
# the same 20 B with momentum; it loads the buffer even without). SGD's (coupled) weight decay and Nesterov
# momentum are free inside the fused kernel; foreach spends a pass on each: _foreach_add(grads, params) out of
# place and _foreach_add_(grads, bufs), 12 B each.
SGD_BYTES = {("fused", False): 12, ("fused", True): 20, ("foreach", False): 12, ("foreach", True): 32}
SGD_PASS_BYTES = 12
CAST_BYTES, CLIP_BYTES = 6, 12
OPTIMIZER_IMPL = {"fused": "fused", "compiled": "foreach", "eager": "foreach"}


@dataclass(frozen=True)
class Op:
    name: str
    fwd: tuple[float, float, float, float]   # element passes per token: (h, ffn, h + kv, vocab) coefficients
    bwd: tuple[float, float, float, float]


_FUSED_CE = Op("cross-entropy (fused)", (0, 0, 0, 1), (0, 0, 0, 2))
_EAGER_CE = Op("cross-entropy (fp32 cast, log_softmax, nll)", (0, 0, 0, 7), (0, 0, 0, 11))


def layer_ops(g, kernels: str, fused_loss: bool | None = None, fp8: bool = False) -> list[Op]:
    """The memory-bound ops of one layer (and the loss, per model) that ``kernels`` leaves as separate passes."""
    ops = _layer_ops(g, kernels, fp8)
    ops.append(_FUSED_CE if (kernels != "eager" if fused_loss is None else fused_loss) else _EAGER_CE)
    return ops


def _layer_ops(g, kernels: str, fp8: bool) -> list[Op]:
    rms, rope = g.norm == "rmsnorm", not g.learned_pos
    if kernels == "eager":
        norm = (Op("2 RMSNorm (pow, mean, rsqrt, 2 mul)", (14, 0, 0, 0), (36, 0, 0, 0)) if rms else
                Op("2 LayerNorm (native kernel + weight-gradient kernel)", (4, 0, 0, 0), (10, 0, 0, 0)))
        ops = [norm, Op("2 residual adds", (6, 0, 0, 0), (6, 0, 0, 0))]
        ops.append(Op("SwiGLU (silu, mul)", (0, 5, 0, 0), (0, 9, 0, 0)) if g.gated else
                   Op("GeLU", (0, 2, 0, 0), (0, 3, 0, 0)))
        if rope:
            ops.append(Op("rotary on q, k (fp32 cast, complex mul, cast back)", (0, 0, 10, 0), (0, 0, 10, 0)))
        return ops
    if kernels == "compiled":
        ops = [Op("2 residual add + norm (one kernel each)", (8, 0, 0, 0), (8, 0, 0, 0))]
    else:
        ops = [Op("2 norms (fused)", (4, 0, 0, 0), (6, 0, 0, 0)),
               Op("2 bias-dropout-add (fused)", (6, 0, 0, 0), (6, 0, 0, 0))]
    ops.append(Op("SwiGLU (fused)", (0, 3, 0, 0), (0, 5, 0, 0)) if g.gated else
               Op("bias-GeLU (fused)", (0, 2, 0, 0), (0, 3, 0, 0)))
    if rope:
        ops.append(Op("rotary on q, k (fused)", (0, 0, 2, 0), (0, 0, 2, 0)))
    if fp8 and kernels == "fused":
        # Transformer Engine's LayerNormLinear / LayerNormMLP write the norms' and the activation's outputs in FP8
        # from the same kernel: their 16-bit write and the FP8 cast's 16-bit read of them (gemm.fp8_cast_bytes
        # counts it) are not made
        ops.append(Op("FP8 cast fused into the norms and activation", (-4, -2, 0, 0), (0, 0, 0, 0)))
    return ops


def _elems(coef, g) -> tuple[float, float]:
    """(per layer, per model) elements per token of one op's coefficients."""
    h, f, qk, v = coef
    return h * g.hidden + f * g.ffn + qk * (g.hidden + g.kv_dim), v * g.vocab


@lru_cache(maxsize=4096)   # pure in hashable values (a frozen GPTShape): the search asks once per candidate
def layer_bytes(g, kernels: str, act_bytes: float, recompute: str = "none", fused_loss: bool | None = None,
                fp8: bool = False) -> tuple[float, float]:
    """Bytes per token of the memory-bound ops: (per layer, per model: the loss). Full recompute runs each layer's
    forward twice; selective recompute re-runs only attention's core (inside FlashAttention: no pass here)."""
    layer = model = 0.0
    for op in layer_ops(g, kernels, fused_loss, fp8):
        fl, fm = _elems(op.fwd, g)
        bl, bm = _elems(op.bwd, g)
        layer += fl * (2 if recompute == "full" else 1) + bl
        model += fm + bm
    return layer * act_bytes, model * act_bytes


def step_seconds(m, c, t, s) -> float:
    """One GPU's seconds a step of the per-layer ops and the loss: tokens of the step over the world (sequence
    parallelism splits the norms and adds over tp, the layers go over pp, the tokens over dp x cp; the loss is
    vocabulary-parallel over tp), at BANDWIDTH_SHARE of the memory bandwidth. Pipeline imbalance is applied by
    the caller with the rest of compute."""
    bw = c.gpu.memory_Bps * BANDWIDTH_SHARE
    if bw <= 0 or m.gpt is None:
        return 0.0
    g = m.gpt
    per_layer, per_model = layer_bytes(g, t.kernels, t.bytes["act"], s.recompute, t.fused_loss,
                                       t.precision == "fp8")
    tokens = t.global_batch * g.seq
    return tokens * (g.layers * per_layer + per_model) / s.world / bw


def optimizer_parts(t) -> dict[str, int]:
    """Bytes per parameter the optimizer step moves, by part: the update; the 16-bit copy only where the
    weights are not already in the working dtype (fp32/tf32, or fp32 weights under autocast); clipping only when
    it is on."""
    impl = OPTIMIZER_IMPL[t.kernels]
    if t.optimizer in ("adam", "adamw"):
        out = {f"AdamW {impl}": ADAM_BYTES[impl]}
    else:
        momentum = t.optimizer == "sgd-momentum"
        out = {f"SGD{' momentum' if momentum else ''} {impl}": SGD_BYTES[(impl, momentum)]}
        if impl == "foreach" and t.weight_decay:
            out["weight decay (foreach)"] = SGD_PASS_BYTES
        if impl == "foreach" and t.nesterov and momentum:
            out["Nesterov (foreach)"] = SGD_PASS_BYTES
    if t.bytes["master"] and not t.autocast:
        out["16-bit copy"] = CAST_BYTES
    if t.clip_grad:
        out["gradient clipping"] = CLIP_BYTES
    return out


def optimizer_bytes_per_param(t) -> float:
    """Bytes the optimizer step (with the 16-bit copy and gradient clipping) moves per parameter it updates."""
    return sum(optimizer_parts(t).values())


def optimizer_seconds(params_per_gpu: float, c, t) -> float:
    bw = c.gpu.memory_Bps * BANDWIDTH_SHARE
    return params_per_gpu * optimizer_bytes_per_param(t) / bw if bw > 0 else 0.0
