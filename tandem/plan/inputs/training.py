"""Typed inputs of a plan: how to train (Training) and how to split it (Strategy: ParallelDims + knobs)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter

from tandem.core.dims import ParallelDims, from_spec
from tandem.core.errors import ConfigError
from tandem.plan.inputs.runtime import RUNTIMES, get_runtime

# bytes per parameter of the working weights, gradients and activations; `master` is the FP32
# copy of the weights mixed precision keeps in the optimizer (ZeRO paper, section 3.1).
PRECISIONS = {
    "fp32": dict(param=4, grad=4, act=4, master=0),
    "tf32": dict(param=4, grad=4, act=4, master=0),   # FP32 storage, TF32 tensor-core math
    "bf16": dict(param=2, grad=2, act=2, master=4),
    "fp16": dict(param=2, grad=2, act=2, master=4),
    "fp8": dict(param=2, grad=2, act=2, master=4),    # Transformer-Engine style: FP8 GEMMs, BF16 storage
}

# Optimizer state bytes per parameter, besides the master copy: Adam keeps m and v in FP32.
OPTIMIZERS = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
ATTENTION_KERNELS = ("unfused", "fused", "fa1", "triton", "fa2", "fa3", "cudnn")   # terms/efficiency.py
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
# The modes of the framework choices, each modelled in its term module:
KERNELS = ("fused", "compiled", "eager")              # what the framework fuses: terms/bandwidth_bound.py
FSDP_IMPLS = ("fsdp1", "fsdp2")                       # ZeRO-3's implementation: terms/fsdp_copies.py
PP_GRAD_SYNC = ("microbatch", "step", "round")        # when a pipeline reduces sharded gradients: terms/grad_sync.py
CP_IMPLS = ("megatron", "torch", "allgather")         # ring attention: terms/context.py
TP_OVERLAP = ("none", "bulk", "ring")                 # tensor-parallel overlap: terms/tensor_parallel.py


def _choice(value: str, valid, field: str) -> str:
    if type(value) is str and value in valid:   # already canonical: the search builds thousands of strategies
        return value
    v = str(value).lower()
    if v not in valid:
        raise ConfigError(f"unknown {field} (got {value!r})", field=field, value=value,
                          fix=f"use one of {', '.join(valid)}")
    return v


@dataclass
class Training:
    global_batch: int = 256                  # samples per optimizer step, all GPUs together
    precision: str = "bf16"
    optimizer: str = "adamw"
    efficiency: float | None = None          # fraction of the reference FLOP/s sustained (None: default)
    overlap: float | None = None             # override: fraction of the overlap window that hides DP
                                             # communication (None: as the framework schedules it)
    flash_attention: bool = False            # fused attention (FlashAttention, cuDNN/TE): no s x s score matrix
                                             # stored, so no 5as/h term without recompute
    attention_kernel: str = ""               # unfused | fused | fa1 | triton | fa2 | fa3 | cudnn (terms/efficiency.py); "": from
                                             # flash_attention (fused: the architecture's usual kernel)
    overlap_param_gather: bool = False       # ZeRO-1/2: gather updated params during the next forward
                                             # (Megatron --overlap-param-gather); else exposed
    grad_reduce: str | None = None           # dtype gradients are reduced in: fp32 | bf16 | fp16 (None: the
                                             # framework's, collectives.grad_reduce_bytes)
    pp_grad_sync: str = "microbatch"         # ZeRO-2/3 under a pipeline: gradients reduce-scattered every micro-batch
                                             # | "step": accumulated unsharded in the reduce dtype, reduced once a step
                                             # (torch.distributed.pipelining) | "round": once a round of the
                                             # interleaved schedule (Llama 3); terms/grad_sync.py
    compute_time_s: float | None = None      # measured compute time per step per GPU (replaces FLOPs/rate)
    steps: int | None = None                 # length of the run, one of steps / tokens / samples
    tokens: float | None = None
    samples: float | None = None
    ref_batch: int = 0                       # batch the LR was tuned at (0: unknown)
    warmup_steps: int = 0
    bucket_bytes: float = 25 * 1024**2       # DDP bucket_cap_mb (25 MiB default)
    threads_per_worker: int | None = None    # CPU workers' intra-op threads (None: cores / workers)
    clip_grad: bool = True                   # gradient clipping by norm in the optimizer step (Megatron's default;
                                             # a job spec: optim.clip_grad_norm > 0)
    autocast: bool = False                   # 16-bit compute under autocast, weights kept in fp32 (tandem's
                                             # trainer): the step writes no 16-bit copy, ZeRO/FSDP gather fp32
    weight_decay: bool = False               # SGD's coupled weight decay is on, and Nesterov momentum (a job spec:
    nesterov: bool = False                   # optim.weight_decay > 0, optim.nesterov): a foreach pass each
                                             # (terms/bandwidth_bound.py; torch's defaults, the flags' plans: off)
    cp_impl: str = "megatron"                # ring attention: Megatron-core/TE's p2p ring, torch's context_parallel as
                                             # torchtitan runs it, or Meta's all-gather CP (terms/context.py)
    kv_repeat: bool = False                  # K/V repeated to every query head before attention (GQA the kernel does
                                             # not take: torchtitan's Llama, repeat_kv, Dec 2024): what the ring moves
    kernels: str = "fused"                   # what the framework fuses (terms/bandwidth_bound.py): fused (Megatron/NeMo/TE,
                                             # the default) | compiled (torch.compile) | eager (PyTorch eager)
    fused_loss: bool | None = None           # a fused cross-entropy kernel (None: as `kernels` has it; eager
                                             # stacks may still use one, e.g. llm-foundry's flash-attn loss)
    fsdp: str = "fsdp2"                      # ZeRO-3 as torch's fully_shard (FSDP2, tandem's trainer, torchtitan) or
                                             # FullyShardedDataParallel (fsdp1): its copies (fsdp_copies.py)
    tp_overlap: str = "none"                 # tensor-parallel AG/RS behind their GEMMs: none | bulk | ring
                                             # (TE userbuffers, torch async TP: terms/tensor_parallel.py)
    overlap_p2p: bool = False                # interleaved pipeline sends posted async, waited before use
                                             # (Megatron-core overlap_p2p_comm: terms/pipeline.py); else blocking
    runtime: str = "tandem"                  # the framework whose rules are planned where they differ (runtime.py):
                                             # tandem | torchtitan | megatron | megatron-2021 | deepspeed-2021; the
                                             # CLI also takes its attention kernel and gradient dtype as defaults
    allocator_reserve: float = 0.0           # torch.cuda reserved over allocated, minus 1 (--allocator-reserve; memory.py)
    runtime_efficiency: bool = False         # efficiency is the runtime's end-to-end share, not given (set below)

    def __post_init__(self):
        if not isinstance(self.global_batch, int) or self.global_batch <= 0:
            raise ConfigError("must be a positive integer", field="global-batch", value=self.global_batch,
                              fix="give --global-batch >= 1")
        self.precision = _choice(self.precision, PRECISIONS, "precision")
        self.optimizer = _choice(self.optimizer.replace("_", "-"), OPTIMIZERS, "optimizer")
        self.cp_impl = _choice(self.cp_impl, CP_IMPLS, "cp-impl")
        self.kernels = _choice(self.kernels, KERNELS, "kernels")
        self.fsdp = _choice(self.fsdp, FSDP_IMPLS, "fsdp")
        self.tp_overlap = _choice(self.tp_overlap, TP_OVERLAP, "tp-overlap")
        self.pp_grad_sync = _choice(self.pp_grad_sync, PP_GRAD_SYNC, "pp-grad-sync")
        if self.attention_kernel:
            self.attention_kernel = _choice(self.attention_kernel, ATTENTION_KERNELS, "attention-kernel")
            self.flash_attention = self.attention_kernel != "unfused"
        else:
            self.attention_kernel = "fused" if self.flash_attention else "unfused"
        self.runtime = get_runtime(self.runtime).name
        rt_eff = RUNTIMES[self.runtime].efficiency
        if self.efficiency is None and rt_eff is not None:   # the runtime's one end-to-end rate (deepspeed-2021)
            self.efficiency, self.runtime_efficiency = rt_eff, True
        if not 0 <= self.allocator_reserve <= 1:
            raise ConfigError("must be in [0, 1]", field="allocator-reserve", value=self.allocator_reserve,
                              fix="give the caching allocator's reserved bytes over allocated, minus 1, e.g. 0.05")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ConfigError("must be in (0, 1]", field="efficiency", value=self.efficiency,
                              fix="give the fraction of peak FLOP/s the model sustains, e.g. 0.4")
        if self.grad_reduce is not None:   # case as --precision and --attention-kernel take it
            self.grad_reduce = str(self.grad_reduce).lower()
        if self.grad_reduce is not None and self.grad_reduce not in ("fp32", "bf16", "fp16"):
            raise ConfigError("must be fp32, bf16 or fp16", field="grad-reduce", value=self.grad_reduce,
                              fix="give --grad-reduce fp32 (Megatron-LM's default for bf16) or bf16")
        if self.overlap is not None and not 0 <= self.overlap <= 1:
            raise ConfigError("must be in [0, 1]", field="overlap", value=self.overlap,
                              fix="0 = no overlap (the seed's arithmetic), 1 = full overlap")
        if self.compute_time_s is not None and self.compute_time_s <= 0:
            raise ConfigError("must be positive", field="compute-time", value=self.compute_time_s,
                              fix="give the measured seconds of forward+backward per step")
        if self.threads_per_worker is not None and (not isinstance(self.threads_per_worker, int)
                                                    or self.threads_per_worker < 1):
            raise ConfigError("must be a positive integer", field="threads-per-worker",
                              value=self.threads_per_worker, fix="give --threads-per-worker 1 or more")
        for k in ("steps", "tokens", "samples"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ConfigError("must be positive", field=k, value=v, fix=f"give --{k} > 0")

    @property
    def bytes(self) -> dict[str, int]:
        return PRECISIONS[self.precision]

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer bytes per parameter incl. the FP32 master copy (K in the ZeRO paper: 12 for
        mixed-precision Adam)."""
        return self.bytes["master"] + OPTIMIZERS[self.optimizer]

    @property
    def gather_bytes(self) -> int:
        """Bytes per parameter a ZeRO/FSDP parameter all-gather moves: the stored weights' dtype. Under autocast
        (tandem's trainer) the parameters stay fp32: its FSDP2 ``fully_shard`` has no MixedPrecisionPolicy
        (tandem/train/parallel/fsdp.py), so it gathers the fp32 shards as stored, and ZeRO-1's
        ZeroRedundancyOptimizer broadcasts fp32 slices; else the 16-bit working copy (Megatron, FSDP with
        param_dtype=bf16)."""
        return 4 if self.autocast else self.bytes["param"]


@dataclass(init=False)
class Strategy:
    """One way to run the job: the parallel degrees, owned by ParallelDims (tandem.core.dims, the
    same object the trainer builds its DeviceMesh from), and the planner's per-step knobs.

    ``Strategy(dims, micro_batch=...)``, or the degrees in the planner's terms, ``Strategy(dp=8,
    tp=2, zero=3, hsdp=True, ranks_per_node=8)``, turned into dims by ParallelDims.from_degrees.
    ``from_job`` reads a job spec's parallel section the way `tandem train` does.
    """
    dims: ParallelDims
    micro_batch: int = 0          # samples per GPU per forward/backward (0: global_batch / dp)
    schedule: str = "1f1b"
    virtual: int = 1              # interleaved: model chunks per pipeline stage
    recompute: str = "none"
    stage_layers: tuple[int, ...] | None = None   # layers per pipeline stage (None: the planner's split)

    def __init__(self, dims: ParallelDims | None = None, micro_batch: int = 0, schedule: str = "1f1b",
                 virtual: int = 1, recompute: str = "none", stage_layers: tuple[int, ...] | None = None, *,
                 dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, hsdp: bool = False,
                 ranks_per_node: int | None = None, cp: int = 1, ep: int = 1) -> None:
        if dims is None:
            for k, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
                if not isinstance(v, int) or v <= 0:
                    raise ConfigError("must be a positive integer", field=k, value=v, fix=f"give --{k} >= 1")
            if zero not in (0, 1, 2, 3):
                raise ConfigError("must be 0, 1, 2 or 3", field="zero", value=zero,
                                  fix="0 = DDP, 1/2/3 = ZeRO stage (3 = FSDP full shard)")
            if dp % ep:
                raise ConfigError(f"ep {ep} must divide dp {dp} (expert parallelism is carved out of the "
                                  f"data-parallel ranks: {dp} % {ep} = {dp % ep})", field="ep", value=ep,
                                  fix=f"choose --ep among the divisors of dp {dp}")
            dims = ParallelDims.from_degrees(dp, tp, pp, zero, hsdp, ranks_per_node, cp, ep)
        self.dims, self.micro_batch, self.stage_layers = dims, micro_batch, stage_layers
        if not isinstance(virtual, int) or virtual <= 0:
            raise ConfigError("must be a positive integer", field="virtual", value=virtual, fix="give --virtual >= 1")
        if not isinstance(self.micro_batch, int) or self.micro_batch < 0:
            raise ConfigError("must be a positive integer", field="micro-batch", value=self.micro_batch,
                              fix="give --micro-batch >= 1")
        self.schedule = _choice(schedule, SCHEDULES, "schedule")
        self.recompute = _choice(recompute, RECOMPUTE, "recompute")
        self.virtual = 1 if self.schedule != "interleaved" else max(2, virtual)

    @classmethod
    def from_job(cls, spec, world: int, local_world: int | None = None) -> "Strategy":
        """A job spec's parallel section on ``world`` ranks, as `tandem train` would lay it out
        (its checks included: ConfigError where the trainer would refuse it)."""
        p = spec.parallel
        return cls(from_spec(spec, world, local_world, warn=False), micro_batch=spec.schedule.micro_batch,
                   schedule=p.pp_schedule, virtual=p.pp_virtual,
                   # tandem's "selective" (every ac_every-th block) has no planner twin
                   recompute="full" if p.activation_checkpoint == "full" else "none")

    # the degrees, read from their owner (attrgetter: the cost model reads them ~10^5 times a search)
    dp = property(attrgetter("dims.dp"))
    tp = property(attrgetter("dims.tp"))
    pp = property(attrgetter("dims.pp"))
    zero = property(attrgetter("dims.zero"))
    hsdp = property(attrgetter("dims.hybrid"))
    cp = property(attrgetter("dims.cp"))
    ep = property(attrgetter("dims.ep"))

    def with_zero(self, zero: int, ranks_per_node: int | None = None) -> "Strategy":
        """The same strategy at another ZeRO stage."""
        d = self.dims
        dims = ParallelDims.from_degrees(d.dp, d.tp, d.pp, zero, d.hybrid, ranks_per_node or d.dp_shard * d.tp * d.cp,
                                         d.cp, d.ep)
        return replace(self, dims=dims)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        s = f"dp{self.dp} tp{self.tp} pp{self.pp}"
        s += (f" cp{self.cp}" if self.cp > 1 else "") + (f" ep{self.ep}" if self.ep > 1 else "")
        s += f" z{self.zero}{'h' if self.hsdp else ''} mb{self.micro_batch}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f"x{self.virtual}" if self.schedule == "interleaved" else "")
        if self.recompute != "none":
            s += f" rc-{self.recompute}"
        if self.stage_layers:
            s += " stages " + ",".join(map(str, self.stage_layers))
        return s


def fused_attention(t: Training, s: Strategy) -> bool:
    """Attention runs fused kernels (no s x s score matrix stored): --flash-attention, or ring attention (cp > 1),
    which is built on fused kernels whatever the flag. The one rule memory, explain and the report share."""
    return t.flash_attention or s.cp > 1
