"""From command-line values (and an optional job spec) to the typed inputs of a plan."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

from tandem.core.config import load_spec
from tandem.core.decoder import ffn_size
from tandem.core.dims import ZERO_STAGE, from_spec
from tandem.core.errors import ConfigError
from tandem.core.steps import planned_steps
from tandem.core.validate import node_counts
from tandem.plan.inputs.calibration import cluster_for
from tandem.plan.inputs.hardware import GPU_ARCH, Cluster, load_cluster_file, make_cluster
from tandem.plan.inputs.measure import measure, measure_module
from tandem.plan.inputs.model import (CNN_PRESETS, GPT_PRESETS, GPTShape, ModelStats, MoEShape, from_hf_config,
                                      gpt_stats, moe_stats, params_only, preset)
from tandem.plan.inputs.runtime import DEFAULT_RUNTIME, Runtime, fused_by_default, get_runtime
from tandem.plan.inputs.training import Strategy, Training


@dataclass
class PlanArgs:
    """Every `tandem plan` option; None means 'not given' (a job spec or the default fills it)."""
    model: str | None = None
    params: float | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn: int | None = None
    seq: int | None = None
    vocab: int | None = None
    gated: bool | None = None
    input_shape: str | None = None
    experts: int | None = None
    top_k: int | None = None
    expert_ffn: int | None = None
    capacity_factor: float | None = None
    gpu: str | None = None
    gpus_per_node: int | None = None
    nodes: int | None = None
    intra: str | None = None
    inter: str | None = None
    nics_per_node: int | None = None
    price: float | None = None
    currency: str | None = None
    cluster: str | None = None
    calibration: str | None = None
    global_batch: int | None = None
    micro_batch: int | None = None
    precision: str | None = None
    optimizer: str | None = None
    recompute: str | None = None
    efficiency: float | None = None
    overlap: float | None = None
    overlap_param_gather: bool | None = None
    grad_reduce: str | None = None
    pp_grad_sync: str | None = None
    flash_attention: bool | None = None
    attention_kernel: str | None = None
    cp_impl: str | None = None
    tp_overlap: str | None = None
    overlap_p2p: bool | None = None
    stage_layers: str | None = None
    compute_time: float | None = None
    kernels: str | None = None
    fsdp: str | None = None
    runtime: str | None = None
    allocator_reserve: float | None = None
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero: int | None = None
    schedule: str | None = None
    virtual: int | None = None
    hsdp: bool | None = None
    steps: int | None = None
    tokens: float | None = None
    samples: float | None = None
    epochs: float | None = None
    ref_batch: int | None = None
    warmup_steps: int | None = None
    threads_per_worker: int | None = None
    config: str | None = None


DEFAULTS = dict(gpu="a100-80gb", gpus_per_node=8, nodes=1, inter="ib-hdr", nics_per_node=1, global_batch=256,
                precision="bf16", optimizer="adamw", recompute="none", overlap=None, tp=1, pp=1, cp=1, ep=1, zero=0,
                schedule="1f1b", virtual=2, hsdp=False, input_shape="3,224,224")


def from_job_spec(path: str) -> dict:
    """The plan inputs a tandem job spec implies (tandem.core.config.load_spec)."""
    spec = load_spec(path, {}, check=False)
    opt = spec.optim.name.lower()
    if opt == "sgd":
        opt = "sgd-momentum" if spec.optim.momentum else "sgd"
    out = dict(model=spec.model.name, global_batch=spec.schedule.global_batch,
               micro_batch=spec.schedule.micro_batch, precision=spec.precision.dtype, optimizer=opt,
               gpus_per_node=spec.launch.nproc_per_node,
               nodes=node_counts(spec.launch).max,   # simulated nodes are the job's nodes, as `tandem train` counts
                ref_batch=spec.optim.ref_batch,
               warmup_steps=spec.schedule.warmup_steps, threads_per_worker=spec.launch.threads_per_worker or None)
    par = spec.parallel
    # the degrees as flags would give them (what `--tp 2` then overrides); without degree flags,
    # `strategy` lays the spec's parallel section out as the trainer does (ParallelDims, "_job")
    out.update(tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, zero=ZERO_STAGE.get(par.strategy, 0), hsdp=par.strategy == "hsdp",
               schedule=par.pp_schedule, virtual=par.pp_virtual, _job=spec)
    # tandem's trainer: eager PyTorch (or torch.compile), foreach AdamW, autocast over fp32 weights
    out["kernels"] = "compiled" if par.compile else "eager"
    out["fused_loss"] = False   # it compiles the blocks only; the loss is a plain F.cross_entropy
    out["_clip_grad"] = spec.optim.clip_grad_norm > 0
    out["_weight_decay"], out["_nesterov"] = spec.optim.weight_decay > 0, bool(spec.optim.nesterov)  # SGD's passes
    out["_autocast"] = spec.precision.dtype in ("bf16", "fp16")
    if out["_autocast"]:   # fp32 gradients, reduced in fp32 unless a 16-bit comm hook compresses them
        out["grad_reduce"] = {"bf16": "bf16", "fp16": "fp16"}.get(par.comm_hook, "fp32")
    if par.activation_checkpoint == "full":  # tandem's "selective" (every ac_every-th block) has no planner twin
        out["recompute"] = "full"
    if spec.model.name == "gpt":  # tandem's own GPT (tandem/models/gpt.py): biases, LayerNorm, learned positions
        m = spec.model
        out.update(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads, ffn=m.ffn, seq=m.seq,
                   vocab=m.vocab)
        out["_tied"] = m.tied
        out["_fused"] = True   # tandem/models/gpt.py runs torch's SDPA: fused kernels, no score matrix stored
    if spec.model.name == "llama":  # tandem/models/llama.py: SwiGLU, RMSNorm, rotary positions, no biases
        m = spec.model
        out.update(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads, ffn=ffn_size(m), seq=m.seq,
                   vocab=m.vocab)
        out["_tied"] = m.tied
        out["_fused"] = True   # SDPA as the GPT
        # (a Qwen-style qkv bias is 3 x hidden numbers a layer: below what the planner resolves)
        out["_shape"] = dict(gated=True, bias=False, norm="rmsnorm", learned_pos=False, dropout=False)
        if m.experts:   # tandem/models/moe.py: every block's MLP a mixture of experts, shared ones beside
            out.update(experts=m.experts, top_k=m.top_k, expert_ffn=m.expert_ffn or m.ffn,
                       capacity_factor=m.capacity_factor)
            out["_moe_shared"] = m.shared_experts
    if spec.model.name in CNN_PRESETS and (spec.model.width != 64 or spec.model.small_input
                                           or spec.model.num_classes != 1000):
        out["_spec_model"] = spec.model
        out["_image"] = (spec.model.in_channels, spec.data.image_size)
    if spec.schedule.max_steps:
        out["steps"] = spec.schedule.max_steps
    return out


def merge(a: PlanArgs) -> tuple[dict, dict]:
    spec = from_job_spec(a.config) if a.config else {}
    v = {f.name: getattr(a, f.name) for f in fields(a)}
    for k, val in spec.items():
        if not k.startswith("_") and v.get(k) is None:
            v[k] = val
    for k, val in DEFAULTS.items():
        if v.get(k) is None:
            v[k] = val
    if a.steps is None and "_job" in spec:  # the steps the trainer will run at this layout (core/steps.py)
        v["steps"] = planned_steps(spec["_job"], v["nodes"] * v["gpus_per_node"], v["tp"], v["pp"],
                                   v["global_batch"], v.get("micro_batch") or 0) or v.get("steps")
    return v, spec


def resolve_model(v: dict, spec: dict) -> ModelStats:
    shape_keys = ("layers", "hidden", "heads", "vocab")
    name = v.get("model")
    if "_spec_model" in spec:  # a small ResNet from a job spec: measure it as it is configured
        # torch and the model zoo only for a job spec's ResNet (a heavy import `tandem plan` otherwise skips)
        import torch

        from tandem.models import build_model

        with torch.device("meta"):
            mod = build_model(spec["_spec_model"])
        c, size = spec["_image"]
        return measure_module(mod, f"{c},{size},{size}", name=spec["_spec_model"].name)
    if v.get("params") is not None and not name:
        return params_only(v["params"])
    if name and ":" in name and not Path(name).suffix == ".json":
        return measure(name, v["input_shape"])
    if name and name.endswith(".json"):
        return from_hf_config(name, v.get("seq"))
    if name in ("gpt", "llama") or (name is None and any(v.get(k) for k in shape_keys)):
        missing = [k for k in shape_keys if not v.get(k)]
        if missing:
            raise ConfigError(f"a GPT shape needs {', '.join('--' + k for k in missing)}", field=missing[0],
                              fix="give --layers --hidden --heads --vocab (and --seq, --ffn, --kv-heads)")
        shape = GPTShape(layers=v["layers"], hidden=v["hidden"], heads=v["heads"], seq=v.get("seq") or 2048,
                         vocab=v["vocab"], kv_heads=v.get("kv_heads") or 0, ffn=v.get("ffn") or 0,
                         tied=spec.get("_tied", True), **{"gated": bool(v.get("gated")), **spec.get("_shape", {})})
        if v.get("experts") is not None:
            return with_moe(MoEShape(shape, experts=v["experts"], top_k=v.get("top_k") or 1,
                                     expert_ffn=v.get("expert_ffn") or shape.ffn,
                                     shared=spec.get("_moe_shared", 0)), v, name or "moe")
        return gpt_stats(shape, name=name or "gpt", source="job spec" if "_tied" in spec else "formula")
    if name is None:
        raise ConfigError("no model given", field="model",
                          fix="name one as the first argument (tandem plan resnet50 | gpt3-175b | llama2-7b | "
                              "gpt --layers ... | config.json | pkg.mod:factory), or give --config job.toml "
                              "or --params N")
    m = preset(name, v.get("seq"))
    if m.moe is not None and any(v.get(k) is not None for k in MOE_KEYS):
        return with_moe(m.moe, v, name)
    if v.get("params") is not None and name not in GPT_PRESETS:
        m.params = int(v["params"])  # a preset's compute with an explicit parameter count (e.g. 25.6e6)
    return m


MOE_KEYS = ("experts", "top_k", "expert_ffn", "capacity_factor")


def with_moe(moe, v: dict, name: str) -> ModelStats:
    """An MoE shape with the --experts/--top-k/--expert-ffn/--capacity-factor given, checked."""
    kw = {k: v[k] for k in MOE_KEYS if v.get(k) is not None}
    moe = replace(moe, **kw)
    for k in ("experts", "top_k", "expert_ffn"):
        x = getattr(moe, k)
        if not isinstance(x, int) or x <= 0:
            raise ConfigError("must be a positive integer", field=k.replace("_", "-"), value=x,
                              fix=f"give --{k.replace('_', '-')} >= 1")
    if moe.top_k > moe.experts:
        raise ConfigError(f"top-k {moe.top_k} is more than the {moe.experts} experts", field="top-k",
                          value=moe.top_k, fix=f"give --top-k between 1 and {moe.experts}")
    if not moe.capacity_factor > 0:
        raise ConfigError("must be positive (token slots per expert over its balanced share)",
                          field="capacity-factor", value=moe.capacity_factor,
                          fix="give --capacity-factor 1.0 (each expert padded to its balanced share) or more")
    return moe_stats(moe, name)


def resolve_cluster(v: dict, spec: dict | None = None) -> Cluster:
    kw = dict(gpu=v["gpu"], gpus_per_node=v["gpus_per_node"], nodes=v["nodes"], intra=v.get("intra"),
              inter=v["inter"], nics_per_node=v["nics_per_node"], price_per_gpu_hour=v.get("price"))
    given = set(v.get("_given", ()))
    file_cluster = None
    if v.get("cluster"):
        file_cluster = load_cluster_file(v["cluster"], **{k: x for k, x in kw.items() if k in given})
        given |= cluster_file_keys(v["cluster"])
        v.update(gpu=file_cluster.gpu.name, gpus_per_node=file_cluster.gpus_per_node, nodes=file_cluster.nodes,
                 intra=file_cluster.intra.name, inter=file_cluster.inter.name,
                 nics_per_node=file_cluster.nics_per_node)
    if v.get("calibration"):
        # a job spec's launch shape is the job's, as if given on the command line
        given |= {k for k in ("gpus_per_node", "nodes") if k in (spec or {})}
        return cluster_for(v["calibration"], v, given, file_cluster)
    return file_cluster if file_cluster is not None else make_cluster(**kw)


def cluster_file_keys(path: str) -> set[str]:
    keys = set(yaml.safe_load(Path(path).read_text()) or {})
    return {"gpu" if k == "custom_gpu" else k for k in keys}


def resolve(a: PlanArgs) -> tuple[ModelStats, Cluster, Training, dict]:
    v, spec = merge(a)
    v["_given"] = {f.name for f in fields(a) if getattr(a, f.name) is not None}
    v["_job"] = spec.get("_job")
    m = resolve_model(v, spec)
    c = resolve_cluster(v, spec)
    c.currency = currency(v.get("currency"))
    if c.gpu.name == "cpu" and "precision" not in v["_given"] and "precision" not in spec:
        v["precision"] = "fp32"  # CPU workers train in fp32 unless told otherwise (tandem's default)
    samples = v.get("samples")
    if v.get("epochs") is not None:
        if not samples:
            raise ConfigError("--epochs needs --samples (the data set size)", field="epochs",
                              value=v["epochs"], fix="give --samples N --epochs E")
        samples = samples * v["epochs"]
    rt = get_runtime(v.get("runtime") or DEFAULT_RUNTIME)
    v["runtime"] = rt.name
    grad_reduce = v.get("grad_reduce")
    if grad_reduce is None and rt.grad_reduce and v["precision"] in ("bf16", "fp16", "fp8"):
        grad_reduce = rt.grad_reduce   # the runtime's reduction dtype for 16-bit gradients (runtime.py)
        v["_grad_reduce_runtime"] = True
    t = Training(global_batch=v["global_batch"], precision=v["precision"], optimizer=v["optimizer"],
                 efficiency=v.get("efficiency"), overlap=v["overlap"], runtime=rt.name,
                 allocator_reserve=v.get("allocator_reserve") or 0.0,
                 overlap_param_gather=bool(v.get("overlap_param_gather")), grad_reduce=grad_reduce,
                 pp_grad_sync=_given_or(v, "pp_grad_sync", "microbatch"),
                 flash_attention=fused_default(v, spec, rt, c), attention_kernel=_given_or(v, "attention_kernel", ""),
                 compute_time_s=v.get("compute_time"), kernels=v.get("kernels") or "fused",
                 steps=v.get("steps"), tokens=v.get("tokens"), samples=samples, ref_batch=v.get("ref_batch") or 0,
                 warmup_steps=v.get("warmup_steps") or 0, threads_per_worker=v.get("threads_per_worker"),
                 cp_impl=_given_or(v, "cp_impl", "megatron"), tp_overlap=_given_or(v, "tp_overlap", "none"),
                 overlap_p2p=bool(v.get("overlap_p2p")),
                 clip_grad=spec.get("_clip_grad", True),
                 weight_decay=spec.get("_weight_decay", False), nesterov=spec.get("_nesterov", False),
                 fused_loss=v.get("fused_loss"), fsdp=_given_or(v, "fsdp", "fsdp2"),
                 # tandem's trainer keeps fp32 weights: a 16-bit precision (the spec's or --precision) is autocast
                 autocast="_job" in spec and v["precision"] in ("bf16", "fp16"))
    return m, c, t, v


def currency(code: str | None) -> str:
    """The unit --price is in (ISO 4217-style code, default USD): every cost is printed with it."""
    if code is None:
        return "USD"
    c = str(code).strip().upper()
    if not re.fullmatch(r"[A-Z]{3}", c):
        raise ConfigError("must be a three-letter currency code", field="currency", value=code,
                          fix="give e.g. --currency USD, EUR or GBP (the unit --price is in)")
    return c


def fused_default(v: dict, spec: dict, rt: Runtime | None = None, c: Cluster | None = None) -> bool:
    """--flash-attention as given; else fused for tandem's own GPT (SDPA), for ring attention (cp > 1: built on
    fused kernels) and where the runtime runs a fused kernel on this GPU (runtime.py: SDPA's flash/cuDNN backends
    on Ampere and later), unfused otherwise (Korthikanti et al.'s eager attention: --runtime megatron-2021)."""
    if v.get("flash_attention") is not None:
        return bool(v["flash_attention"])
    if rt is not None and c is not None and fused_by_default(rt, GPU_ARCH.get(c.gpu.name)) \
            and v["precision"] in ("bf16", "fp16", "fp8"):
        v["_fused_runtime"] = True
        return True
    return bool(spec.get("_fused")) or (isinstance(v.get("cp"), int) and v["cp"] > 1)


DEGREE_FLAGS = {"dp", "tp", "pp", "cp", "ep", "zero", "hsdp"}


def strategy(v: dict, c: Cluster, t: Training) -> Strategy:
    knobs = dict(micro_batch=v.get("micro_batch") or 0, schedule=v["schedule"], virtual=v["virtual"],
                 recompute=v["recompute"], stage_layers=parse_stage_layers(v.get("stage_layers")))
    job = v.get("_job")
    if job is not None and not DEGREE_FLAGS & set(v.get("_given", ())):
        # a job spec alone: its parallel section on this cluster, laid out as `tandem train` would
        # (ParallelDims: hsdp's dp_shard included); its checks are the trainer's
        return Strategy(from_spec(job, c.world, c.gpus_per_node, warn=False), **knobs)
    tp, pp, cp, ep = v["tp"], v["pp"], v["cp"], v["ep"]
    for k in ("tp", "pp", "cp", "ep"):
        if not isinstance(v[k], int) or v[k] <= 0:
            raise ConfigError("must be a positive integer", field=k, value=v[k], fix=f"give --{k} >= 1")
    dp = v.get("dp")
    if dp is None and cp > 1:
        if c.world % (tp * pp * cp):
            raise ConfigError(f"tp {tp} x pp {pp} x cp {cp} = {tp * pp * cp} does not divide the {c.world} GPUs "
                              f"({c.world} % {tp * pp * cp} = {c.world % (tp * pp * cp)})", field="cp", value=cp,
                              fix="choose --cp so that tp x pp x cp divides the GPU count, or change "
                                  "--gpus-per-node/--nodes")
        dp = c.world // (tp * pp * cp)
    if dp is None:
        if c.world % (tp * pp):
            # name the degree the user can change: tp alone already fails, or pp is what breaks it
            k, val, other = ("tp", tp, pp) if c.world % tp else ("pp", pp, tp)
            ok = [d for d in range(1, c.world // other + 1) if c.world % (d * other) == 0]
            raise ConfigError(f"tp {tp} x pp {pp} = {tp * pp} does not divide the {c.world} GPUs", field=k,
                              value=val, fix=f"choose --{k} among {', '.join(map(str, ok))} (with "
                                             f"{'pp' if k == 'tp' else 'tp'} {other}), or change "
                                             "--gpus-per-node/--nodes")
        dp = c.world // (tp * pp)
    return Strategy(dp=dp, tp=tp, pp=pp, zero=v["zero"], hsdp=v["hsdp"], ranks_per_node=c.gpus_per_node, cp=cp,
                    ep=ep, **knobs)


def parse_stage_layers(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError("must be comma-separated layer counts", field="stage-layers", value=text,
                          fix="give one count per pipeline stage, e.g. --stage-layers 7,8,8,7") from None


def _given_or(v: dict, key: str, default: str) -> str:
    """A choice flag's value, ``default`` when not given; given empty (``--tp-overlap=``) it is refused."""
    if v.get(key) is None:
        return default
    if not str(v[key]).strip():
        raise ConfigError(f"an empty value is not a choice (got {v[key]!r})", field=key.replace("_", "-"),
                          value=v[key], fix=f"give --{key.replace('_', '-')} one of its values, or leave it out")
    return v[key]
