"""Job specs of the parallel tests: tiny GPT, Llama and ResNet runs per strategy and mesh."""

from __future__ import annotations

import copy

from tandem.core.spec import JobSpec


def gpt_job(strategy="ddp", tp=1, pp=1, world=2, dtype="fp32", optim="sgd", **par) -> JobSpec:
    s = JobSpec()
    m = s.model
    m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.seq, m.vocab = "gpt", 4, 32, 4, 2, 8, 16
    m.tied = pp == 1
    s.data.name = "reverse"
    s.parallel.strategy, s.parallel.tp, s.parallel.pp = strategy, tp, pp
    for k, v in par.items():
        setattr(s.parallel, k, v)
    s.optim.name, s.optim.ref_batch, s.optim.weight_decay = optim, 0, 0.0
    s.optim.lr = 0.5 if optim == "sgd" else 1e-2
    s.schedule.global_batch, s.schedule.micro_batch = 16, 4
    s.precision.dtype = dtype
    s.launch.nproc_per_node = world
    return s


def llama_job(strategy="ddp", tp=1, pp=1, world=2, qwen=False, **par) -> JobSpec:
    """The GPT's job on the Llama decoder (SwiGLU of 64 units); ``qwen``: qkv biases and qk-norm too."""
    s = gpt_job(strategy, tp, pp, world, **par)
    s.model.name, s.model.ffn = "llama", 64
    s.model.qkv_bias = s.model.qk_norm = qwen
    return s


def moe_job(strategy="ddp", world=2, ep=1, **par) -> JobSpec:
    """The Llama job with a mixture of experts: 4 experts of 32 units, top 2, one shared expert, capacity
    factor 1 (a micro-batch's 32 tokens x 2 fill 4 experts x 16 slots exactly: some tokens drop), z-loss on."""
    s = llama_job(strategy, world=world, ep=ep, **par)
    m = s.model
    m.experts, m.top_k, m.expert_ffn, m.shared_experts, m.capacity_factor = 4, 2, 32, 1, 1.0
    m.router_aux_loss, m.router_z_loss = 0.01, 1e-3
    return s


def resnet_job(strategy="ddp", world=2) -> JobSpec:
    s = gpt_job(strategy, world=world)
    s.model.name, s.model.width, s.model.in_channels, s.model.small_input = "resnet18", 4, 1, True
    s.data.name, s.data.image_size = "synthetic", 8
    s.optim.lr = 0.05
    return s


def single(spec: JobSpec) -> JobSpec:
    s = copy.deepcopy(spec)
    s.parallel.strategy, s.parallel.tp, s.parallel.pp, s.parallel.cp, s.parallel.ep = "ddp", 1, 1, 1, 1
    return s


STEPS = 3

WORLD2 = {
    "ddp": gpt_job("ddp"),
    "zero1": gpt_job("zero1"),
    "zero2": gpt_job("zero2"),
    "zero3": gpt_job("zero3"),
    "zero3-adamw": gpt_job("zero3", optim="adamw"),
    "tp2": gpt_job(tp=2),
    "tp2-sp": gpt_job(tp=2, sequence_parallel=True),
    "tp2-noloss-parallel": gpt_job(tp=2, loss_parallel=False),
    "pp2-gpipe": gpt_job(pp=2, pp_schedule="gpipe"),
    "pp2-1f1b": gpt_job(pp=2, pp_schedule="1f1b"),
    "pp2-interleaved": gpt_job(pp=2, pp_schedule="interleaved"),
    "zero3-ac-full": gpt_job("zero3", activation_checkpoint="full"),
    "ddp-ac-selective": gpt_job("ddp", activation_checkpoint="selective"),
    "ddp-bf16": gpt_job("ddp", dtype="bf16"),
    "zero3-bf16": gpt_job("zero3", dtype="bf16"),
    "tp2-bf16": gpt_job(tp=2, dtype="bf16"),
    "pp2-bf16": gpt_job(pp=2, dtype="bf16"),
    "hook-fp16": gpt_job("ddp", comm_hook="fp16"),
    "hook-bf16": gpt_job("ddp", comm_hook="bf16"),
    "hook-powersgd": gpt_job("ddp", comm_hook="powersgd", powersgd_rank=2),
    "local-sgd": gpt_job("ddp", local_sgd_every=2, local_sgd_warmup=0),
    "llama-ddp": llama_job("ddp"),
    "llama-zero3": llama_job("zero3"),
    "llama-tp2": llama_job(tp=2),
    "llama-tp2-sp": llama_job(tp=2, sequence_parallel=True),
    "qwen-tp2-sp": llama_job(tp=2, sequence_parallel=True, qwen=True),
    "llama-pp2": llama_job(pp=2),
    "llama-pp2-interleaved": llama_job(pp=2, pp_schedule="interleaved"),
    "llama-zero3-ac-full": llama_job("zero3", activation_checkpoint="full"),
    "resnet-ddp": resnet_job("ddp"),
    "resnet-zero1": resnet_job("zero1"),
    "resnet-zero2": resnet_job("zero2"),
    "resnet-zero3": resnet_job("zero3"),
}
# fp16 with an inf put into one gradient element of rank 1 at step INF_AT, and clipping at CLIP, per
# strategy (test_fp16_clip.py): in the same 2-rank run, not a spawn of their own
FP16_CLIP = {"ddp": {}, "zero3": {"strategy": "zero3"}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}
INF_AT, CLIP = 1, 0.5
for _name, _kw in FP16_CLIP.items():
    WORLD2[f"{_name}-fp16"] = (gpt_job(dtype="fp16", **_kw), {"inf_at": INF_AT, "inf_rank": 1})
    WORLD2[f"{_name}-clip"] = gpt_job(**_kw)
    WORLD2[f"{_name}-clip"].optim.clip_grad_norm = CLIP
WORLD4 = {  # 2 simulated nodes of 2 ranks
    "hsdp": gpt_job("hsdp", world=2),
    "dp2xtp2-zero3": gpt_job("zero3", tp=2, world=2),
    "dp2xtp2-ddp": gpt_job("ddp", tp=2, world=2),
    "dp2xpp2": gpt_job("ddp", pp=2, world=2),
    "dp2xpp2-interleaved": gpt_job("ddp", pp=2, world=2, pp_schedule="interleaved"),
    "tp2xpp2": gpt_job("ddp", tp=2, pp=2, world=2),
    "dp2xtp2-zero2-sp": gpt_job("zero2", tp=2, world=2, sequence_parallel=True),
    "llama-hsdp": llama_job("hsdp", world=2),
    "llama-dp2xtp2-zero3-sp": llama_job("zero3", tp=2, world=2, sequence_parallel=True, qwen=True),
    "llama-tp2xpp2": llama_job("ddp", tp=2, pp=2, world=2),
}
WORLD8 = {"dp2xtp2xpp2": gpt_job("ddp", tp=2, pp=2, world=4),
          "llama-dp2xtp2xpp2": llama_job("ddp", tp=2, pp=2, world=4, qwen=True)}
WORLDS = {2: (WORLD2, 2), 4: (WORLD4, 2), 8: (WORLD8, 4)}
# The quick subset's share of the 2-rank run (conftest.py): one configuration per strategy family
# (~10 s of the ~40 s the 25 take on 2 cores); the tests of the others are slow-marked cases.
QUICK = {2: ("ddp", "zero1", "zero2", "zero3", "tp2", "pp2-1f1b", "resnet-ddp", "qwen-tp2-sp")}

