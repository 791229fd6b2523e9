"""The training runtime a plan is of: which framework, at which version, and the rules that differ between them.

The planner's terms model one way of running each piece (FSDP2's prefetch, Megatron's distributed optimizer,
the attention kernel's published speed, ...). Where frameworks differ, the rule is keyed by the runtime named here
(``--runtime``), each with its source; the default is tandem's own (``tandem train``: torch's FSDP2 / DDP with
SDPA attention). A historical setup (a 2021 paper's) is planned by naming its runtime, not by editing defaults.

Rules, per runtime:
- ``attention``: the attention kernel when none is given: ``sdpa``, a fused kernel where torch's
  scaled_dot_product_attention (or Transformer Engine) has one for the GPU (FlashAttention-2 / cuDNN on Ampere,
  Ada, Hopper, Blackwell, MI300X: FLASH_ARCHS), unfused elsewhere; ``unfused``, the s x s scores in memory (before
  FlashAttention, 2022).
- ``grad_reduce``: the dtype 16-bit gradients are reduced in when --grad-reduce is not given: ``fp32`` at every
  stage (torch under autocast keeps fp32 gradients; FSDP2's MixedPrecisionPolicy(reduce_dtype=float32), as
  torchtitan sets it), or None, collectives.grad_reduce_bytes' rule (fp32 for BF16 at ZeRO-1/2: Megatron's
  distributed optimizer; else the gradients' own dtype).
- ``zero3_prefetch``: ZeRO-3's parameter all-gathers prefetched behind the neighbouring block's compute
  (dp_overlap.fsdp), or waited for where each module's forward/backward needs them (exposed).
- ``efficiency``: None, the per-architecture model (efficiency.py: linear layers, attention and memory-bound
  kernels charged apart); or one end-to-end share of peak for every FLOP, as --efficiency.
- ``loss_parallel``: under tp, the unfused loss runs as torch's ``loss_parallel`` (DTensor's vocabulary-sharded
  cross-entropy, whose fused backward holds 16 B a logit; memory.loss_bytes), not as a plain F.cross_entropy.
- ``pp_outputs``: what torch.distributed.pipelining keeps of each micro-batch until the step ends
  (memory.pipeline_buffers): ``all``, every stage's outputs and its inputs' gradients (torch before PR #153383,
  May 2025, and PR #164329, Oct 2025: the torch torchtitan's report ran, 1963fc8); ``last``, the last stage's
  outputs only, the inputs' gradients freed once sent (torch 2.13); None, not torch's pipelining (not counted).
- ``experts_tp``: an MoE model's routed experts split over the tp ranks too, each GPU holding experts / (ep x tp)
  sharded by ZeRO over the expert-data-parallel ranks dp x cp / ep (Megatron-core's expert-tensor-parallel size
  = tp default; torchtitan either way); or (False, tandem's trainer) each tp rank holding its ep rank's experts
  whole, experts / ep a GPU, the tp ranks sharing their gradients and ZeRO shards: (dp x cp / ep) x tp
  (params.expert_tp, expert_shard_group; expert.expert_dp_group).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.errors import ConfigError

# architectures where SDPA (and Transformer Engine) run a fused attention kernel in 16-bit: FlashAttention-2
# needs sm80+ (Ampere, Ada, Hopper, Blackwell); ROCm's SDPA runs a flash kernel on MI300X (CDNA3). Volta and
# Pascal get the memory-efficient kernel at best, with no published speed: planned unfused.
FLASH_ARCHS = ("ampere", "ada", "hopper", "blackwell", "cdna3")


@dataclass(frozen=True)
class Runtime:
    name: str
    what: str                        # the framework and version the rules describe
    attention: str                   # sdpa | unfused: the kernel when --attention-kernel/--flash-attention is not given
    grad_reduce: str | None          # fp32 | None (collectives.grad_reduce_bytes' rule)
    zero3_prefetch: bool             # ZeRO-3 all-gathers prefetched (FSDP) or exposed
    efficiency: float | None         # one end-to-end share of peak (None: efficiency.py's per-architecture model)
    sources: tuple[tuple[str, str], ...]   # (rule, source)
    loss_parallel: bool = False      # tp's unfused loss is torch's loss_parallel (16 B a logit at its peak)
    pp_outputs: str | None = None    # all | last: what torch's pipelining keeps a step (None: not its pipeline)
    experts_tp: bool = True          # routed experts split over tp (Megatron's ETP = tp), or whole on each tp rank


_FSDP2 = ("zero3_prefetch", "torch FSDP2 fully_shard: the next block's all-gather issued during this block's compute "
                            "(implicit prefetch, forward and backward; Zhao et al. VLDB 2023 §3.3 for FSDP1)")
_LOSS_PARALLEL = ("loss_parallel", "torch.distributed.tensor.parallel.loss_parallel: _nll_loss_and_log_softmax_backward "
                                   "returns (zeros_like(x) + exp(x)) * grad with the saved fp32 log-softmax x alive: "
                                   "16 B a logit at the loss's peak (12 B for F.cross_entropy's own backward)")
_SDPA = ("attention", "torch.nn.functional.scaled_dot_product_attention picks the flash (sm80+) or cuDNN (Hopper) "
                      "backend for bf16/fp16 on these GPUs")
RUNTIMES: dict[str, Runtime] = {r.name: r for r in [
    Runtime("tandem", "tandem train (torch >= 2.4: FSDP2 fully_shard / DDP, SDPA attention)", "sdpa", "fp32", True,
            None, (_SDPA, ("grad_reduce", "autocast over fp32 weights: fp32 gradients, reduced as stored "
                                          "(tandem/train/parallel); FSDP2's MixedPrecisionPolicy(reduce_dtype=fp32) "
                                          "for bf16 weights, as torchtitan"), _FSDP2,
                       (_LOSS_PARALLEL[0], _LOSS_PARALLEL[1] + "; tandem's spec loss_parallel = true"),
                       ("pp_outputs", "not modelled (None): the buffers are counted where FSDP2 runs under "
                                      "torch's pipelining with one reduction a step or round (grad_sync.deferred); "
                                      "tandem's trainer refuses ZeRO with pp > 1, and the published rows planned so "
                                      "under this runtime (Llama 3's) ran Meta's own pipeline"),
                       ("experts_tp", "False: tandem/train/parallel/expert.py keeps each ep rank's experts whole on "
                                      "its tp ranks (Shard(0) on the ep mesh only), their gradients summed and their "
                                      "zero2 / zero3 shards on the flattened edp x tp mesh (ExpertParallel.grad_mesh)")),
            loss_parallel=True, experts_tp=False),
    Runtime("torchtitan", "torchtitan (2024-2025: FSDP2, SDPA, MixedPrecisionPolicy bf16 params / fp32 reduce)",
            "sdpa", "fp32", True, None,
            (_SDPA, ("grad_reduce", "torchtitan's mixed_precision_reduce = float32 default"), _FSDP2,
             (_LOSS_PARALLEL[0], _LOSS_PARALLEL[1] + "; torchtitan's disable_loss_parallel = false default"),
             ("pp_outputs", "torch 1963fc8 (torchtitan's performance report, 2024-12-23) stage.py: forward_one_chunk "
                            "appends every stage's output to output_chunks (cleared at the next step; last stage only "
                            "since PR #153383), stage_backward leaves each input's gradient in the receive buffer's "
                            ".grad until clear_runtime_states (freed early since PR #164329)"),
             ("experts_tp", "torchtitan's expert_tensor_parallel_degree: etp = tp splits the experts over tp "
                            "(ExpertTensorParallel); the default etp = 1 folds the tp ranks into ep (ep = planner ep x "
                            "tp, 'partial dp + all tp -> ep'): experts / (ep x tp) a GPU either way, FSDP over "
                            "dp x cp / ep")),
            loss_parallel=True, pp_outputs="all"),
    Runtime("megatron", "Megatron-LM / NeMo (Megatron-core >= 0.5, Transformer Engine)", "sdpa", None, True, None,
            (("attention", "Transformer Engine's fused attention (cuDNN / FlashAttention-2)"),
             ("grad_reduce", "distributed optimizer: BF16 gradients reduced in FP32 (grad_reduce_in_fp32 with "
                             "--use-distributed-optimizer); else the gradients' dtype"),
             ("experts_tp", "Megatron-core's --expert-tensor-parallel-size defaults to --tensor-model-parallel-size: "
                            "experts / (ep x tp) a GPU, the distributed optimizer over the expert-data-parallel "
                            "ranks"))),
    Runtime("megatron-2021", "Megatron-LM as Narayanan et al. 2021 and Korthikanti et al. 2022 ran it "
                             "(before FlashAttention)", "unfused", None, True, None,
            (("attention", "eager attention: the s x s scores in memory (Korthikanti et al. 2022 §4)"),)),
    Runtime("deepspeed-2021", "DeepSpeed 0.5 (2021): ZeRO-3 stage3.py and the pipeline engine, Megatron kernels",
            "unfused", None, False, 0.50,
            (("attention", "2021, before FlashAttention: eager attention"),
             ("zero3_prefetch", "stage3's PartitionedParameterCoordinator fetches a sub-module's parameters in its "
                                "pre-forward/backward hook and waits for them there: the all-gathers exposed"),
             ("efficiency", "one end-to-end share, 0.50 of peak (Narayanan et al. 2021: 44-52% of A100 peak at "
                            "scale): DeepSpeed's 2021 engines ran Megatron's kernels without the per-architecture "
                            "linear/attention/memory-bound split the tandem rules were measured on"))),
]}
DEFAULT_RUNTIME = "tandem"


def get_runtime(name: str) -> Runtime:
    key = str(name).lower()
    if key not in RUNTIMES:
        raise ConfigError(f"unknown runtime (got {name!r})", field="runtime", value=name,
                          fix=f"use one of {', '.join(RUNTIMES)} (docs/plan.md, 'Runtimes')")
    return RUNTIMES[key]


def fused_by_default(rt: Runtime, arch: str | None) -> bool:
    """The runtime's attention on this architecture (None: a custom GPU or a CPU host): fused or not."""
    return rt.attention == "sdpa" and arch in FLASH_ARCHS
