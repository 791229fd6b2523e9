"""Validation of a job spec before any process starts.

Each check raises ConfigError naming the field, the numbers and the fix, e.g.
``global_batch 1000 is not divisible by 4 workers x micro_batch 256``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tandem.core.decoder import check_llama
from tandem.core.dims import from_spec
from tandem.core.errors import ConfigError
from tandem.core.experts import check_moe
from tandem.core.noderange import NodeRange
from tandem.core.spec import JobSpec, LaunchSpec

LAUNCH_CHOICES = {"device": ("auto", "cpu", "cuda"), "backend": ("auto", "gloo", "nccl")}
CHOICES = {
    "data.name": ("digits", "synthetic", "npz", "reverse", "sort", "tokens"),  # or 'pkg.module:factory'
    "data.remainder": ("pad", "drop"),
    "model.gelu": ("exact", "tanh"),
    "parallel.strategy": ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved"),
    "parallel.pp_split": ("cost", "even"),
    "parallel.activation_checkpoint": ("none", "selective", "full"),
    "parallel.comm_hook": ("none", "fp16", "bf16", "powersgd"),
    "optim.name": ("sgd", "adamw"),
    "schedule.decay": ("cosine", "linear", "constant"),
    "precision.dtype": ("fp32", "bf16", "fp16"),
    "elastic.on_resize": ("keep_batch", "scale_lr"),
    **{f"launch.{k}": v for k, v in LAUNCH_CHOICES.items()},
}


def spec_field(name: str) -> str:
    """How a job spec names a LaunchSpec field in errors (the command-line verbs name their flags)."""
    return f"launch.{name}"


def validate_launch(launch: LaunchSpec, name: Callable[[str], str] = spec_field) -> LaunchSpec:
    """The launch options' own rules, the same for `tandem train`, `launch`, `bench comm` and `doctor`.

    ``name`` turns a LaunchSpec field into what the user wrote (``launch.nnodes`` in a job spec,
    ``--nnodes`` on a command line), so that the error names it. Simulated nodes: ``--simulate-nodes K``
    with ``--nnodes`` 1 (not given), K, or MIN:K (an elastic job of K simulated nodes, MIN to go on).
    """
    for key, choices in LAUNCH_CHOICES.items():
        val = getattr(launch, key)
        if val not in choices:
            raise ConfigError(f"{val!r} is not one of {', '.join(choices)}", field=name(key), value=val,
                              fix=f"use one of: {', '.join(choices)}")
    if launch.nproc_per_node < 1:
        raise ConfigError(f"must be at least 1, got {launch.nproc_per_node}", field=name("nproc_per_node"),
                          value=launch.nproc_per_node, fix="use 1 or more workers per node")
    for key in ("max_restarts", "simulate_nodes", "node_rank"):
        if getattr(launch, key) < 0:
            raise ConfigError(f"must be 0 or more, got {getattr(launch, key)}", field=name(key),
                              value=getattr(launch, key), fix="give 0 or a positive number")
    if launch.timeout_s <= 0:
        raise ConfigError(f"must be positive, got {launch.timeout_s}", field=name("timeout_s"),
                          value=launch.timeout_s, fix="give the seconds to wait for the rendezvous, e.g. 60")
    nodes = NodeRange.parse(launch.nnodes, name("nnodes"))  # the one parse that names the field as written
    k = launch.simulate_nodes
    if k and (nodes.min, nodes.max) != (1, 1) and nodes.max != k:
        raise ConfigError(f"{name('nnodes')} {launch.nnodes} does not fit {name('simulate_nodes')} {k}: the "
                          f"simulated nodes are the job's nodes, so nnodes is 1 (not given), {k}, or MIN:{k}",
                          field=name("nnodes"), value=launch.nnodes,
                          fix=f"drop {name('nnodes')}, or give MIN:{k} for an elastic job")
    if nodes.elastic and not launch.rdzv_endpoint and not k:
        raise ConfigError(f"elastic nnodes {launch.nnodes} needs a c10d rendezvous endpoint",
                          field=name("rdzv_endpoint"), fix=f"add {name('rdzv_endpoint')} HOST:PORT")
    if launch.backend == "nccl" and launch.device == "cpu":
        raise ConfigError("nccl needs CUDA devices", field=name("backend"), value="nccl",
                          fix=f"use {name('backend')} gloo (or auto) on CPU")
    return launch


def node_counts(launch: LaunchSpec) -> NodeRange:
    """The job's nodes, simulated ones included: ``simulate_nodes`` K with nnodes MIN:K is an elastic
    job of K nodes that goes on with MIN; with nnodes 1 (not given) or K, K fixed nodes."""
    nodes, k = launch.nodes, launch.simulate_nodes
    if k:
        return NodeRange(nodes.min if nodes.elastic else k, k)
    return nodes


def world_sizes(launch: LaunchSpec) -> tuple[int, int]:
    """Smallest and largest world size the launch can produce."""
    nodes = node_counts(launch)
    return nodes.min * launch.nproc_per_node, nodes.max * launch.nproc_per_node


def grad_accum(spec: JobSpec, world: int) -> int:
    s = spec.schedule
    per_step = world * s.micro_batch
    if s.global_batch % per_step:
        lo = (s.global_batch // per_step) * per_step
        hint = (f"use global_batch {lo} or {lo + per_step}" if lo else
                f"use global_batch {per_step} (or a multiple of it)")
        raise ConfigError(
            f"global_batch {s.global_batch} is not divisible by {world} workers x micro_batch "
            f"{s.micro_batch} = {per_step}", field="schedule.global_batch", value=s.global_batch,
            fix=f"{hint}, or change micro_batch / workers")
    return s.global_batch // per_step


def effective_lr(spec: JobSpec) -> float:
    o = spec.optim
    return o.lr * spec.schedule.global_batch / o.ref_batch if o.ref_batch else o.lr


def _check_scale_lr(spec: JobSpec) -> None:
    """scale_lr keeps micro x accum, so the global batch is dp x micro x accum at every world. A
    resized run continues the epoch at position D (samples done), D a sum of such global batches;
    every data rank of the new world must get D / dp of them: each dp must divide each global batch."""
    nodes = node_counts(spec.launch)
    n = spec.launch.nproc_per_node
    dps = sorted({from_spec(spec, k * n, warn=False).dp for k in range(nodes.min, nodes.max + 1)})
    m = spec.schedule.micro_batch
    for start in dps:  # the run may start at any allowed world; its accumulation then stays
        accum = grad_accum(spec, start)
        for v in dps:
            for w in dps:
                if (v * m * accum) % w:
                    raise ConfigError(
                        f"scale_lr keeps micro_batch {m} x accumulation {accum} (set at {start} data ranks), so "
                        f"the global batch at {v} data ranks is {v * m * accum}, which {w} data ranks cannot "
                        f"share evenly when the epoch continues at the new world", field="elastic.on_resize",
                        value="scale_lr", fix=f"use a micro_batch that every data-parallel size in {dps} "
                                              f"divides, or elastic.on_resize=keep_batch")


def _check_loss(spec: JobSpec) -> None:
    loss = spec.model.loss
    if loss in ("cross_entropy", "model") or ":" in loss:
        if loss == "model" and ":" not in spec.model.name:
            raise ConfigError(f"the built-in {spec.model.name} returns logits, not a loss", field="model.loss",
                              value=loss, fix="use model.loss=cross_entropy, or a model.name 'pkg.module:factory' "
                                              "whose forward(x, y) returns its loss")
        if loss == "model" and spec.parallel.pp > 1:
            raise ConfigError("the pipeline schedule computes the loss on the last stage's output",
                              field="model.loss", value=loss,
                              fix="with parallel.pp > 1 use cross_entropy or a 'pkg.module:fn' loss function")
        return
    raise ConfigError("unknown loss", field="model.loss", value=loss,
                      fix="use cross_entropy | model | an import path 'pkg.module:fn' returning the summed loss")


def validate(spec: JobSpec) -> JobSpec:
    for key, choices in CHOICES.items():
        sec, name = key.split(".")
        if sec == "launch":
            continue  # validate_launch's
        val = getattr(getattr(spec, sec), name)
        if key == "data.name" and ":" in str(val):
            continue  # your own data set's factory: imported and checked by tandem.data.user
        if val not in choices:
            raise ConfigError(f"{val!r} is not one of {', '.join(choices)}", field=key, value=val,
                              fix=f"set {key} to one of: {', '.join(choices)}")
    positive = {"schedule.global_batch": spec.schedule.global_batch,
                "schedule.micro_batch": spec.schedule.micro_batch,
                "schedule.epochs": spec.schedule.epochs,
                "model.width": spec.model.width, "model.num_classes": spec.model.num_classes,
                "data.image_size": spec.data.image_size, "schedule.log_every": spec.schedule.log_every,
                "profile.start_step": spec.profile.start_step, "profile.steps": spec.profile.steps,
                "profile.clock_rounds": spec.profile.clock_rounds, "data.num_samples": spec.data.num_samples}
    for key, val in positive.items():
        if val < 1:
            raise ConfigError(f"must be at least 1, got {val}", field=key, value=val, fix="give a positive number")
    nonneg = {"schedule.max_steps": spec.schedule.max_steps, "schedule.warmup_steps": spec.schedule.warmup_steps,
              "checkpoint.every_steps": spec.checkpoint.every_steps, "optim.ref_batch": spec.optim.ref_batch}
    for key, val in nonneg.items():
        if val < 0:
            raise ConfigError(f"must be 0 or more, got {val}", field=key, value=val, fix="give 0 or a positive number")
    if spec.checkpoint.keep_last < 1:
        raise ConfigError(f"must keep at least 1 checkpoint, got {spec.checkpoint.keep_last}",
                          field="checkpoint.keep_last", fix="set checkpoint.keep_last >= 1")
    if not 0.0 <= spec.data.held_out < 1.0:
        raise ConfigError(f"{spec.data.held_out} is not a fraction in [0, 1)", field="data.held_out",
                          fix="use e.g. 0.2")
    if spec.optim.lr <= 0:
        raise ConfigError(f"must be positive, got {spec.optim.lr}", field="optim.lr", fix="use e.g. 0.1")
    if not spec.optim.clip_grad_norm >= 0:  # NaN too
        raise ConfigError("a gradient norm must be 0 (off) or positive", field="optim.clip_grad_norm",
                          value=spec.optim.clip_grad_norm, fix="use e.g. 1.0, or 0 to turn clipping off")
    _check_loss(spec)
    if spec.model.name == "llama":
        check_llama(spec.model)
    check_moe(spec.model)
    if spec.elastic.term_grace_s <= 0:
        raise ConfigError(f"must be positive, got {spec.elastic.term_grace_s}", field="elastic.term_grace_s",
                          fix="use e.g. 10 (seconds), below torchrun's 30 s; elastic.save_on_term=false turns "
                              "the graceful stop off")

    validate_launch(spec.launch)
    lo, hi = world_sizes(spec.launch)
    # The degrees' owner (ParallelDims) checks tp/pp/dp arithmetic before any process starts.
    for world in sorted({lo, hi}):
        grad_accum(spec, from_spec(spec, world, warn=world == hi).dp)
    if spec.elastic.on_resize == "scale_lr" and lo != hi:
        _check_scale_lr(spec)
    launch = spec.launch
    if spec.elastic.join and (not launch.nodes.elastic or not launch.rdzv_endpoint or launch.simulate_nodes):
        raise ConfigError("joining a running job needs elastic nnodes MIN:MAX and the job's c10d rendezvous "
                          "endpoint (and no simulated nodes)", field="elastic.join", value=True,
                          fix="give the running job's --launch.nnodes MIN:MAX and --launch.rdzv_endpoint HOST:PORT")

    if spec.data.name == "npz":
        p = Path(spec.data.path)
        if not spec.data.path or not p.is_file():
            raise ConfigError("data file not found", field="data.path", value=spec.data.path or "(empty)",
                              fix="give an existing .npz with arrays x and y, or use data.name=digits")
    resume = spec.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).exists():
        raise ConfigError("checkpoint not found", field="checkpoint.resume", value=resume,
                          fix="give an existing checkpoint folder, or 'auto' / 'none'")
    dev = spec.launch.device
    if spec.model.sync_bn and dev == "cpu":
        raise ConfigError("torch's SyncBatchNorm runs only on GPUs", field="model.sync_bn", value=True,
                          fix="set model.sync_bn=false on CPU (each rank keeps its own BatchNorm statistics)")
    return spec
