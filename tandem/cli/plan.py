"""`tandem plan`: predict memory, communication, step time and cost of a strategy, or search for one.

Pure arithmetic plus (for pkg.mod:factory models) a measurement on the meta device;
it never starts a process or touches a GPU.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from tandem.core.errors import ConfigError, TandemError

O = typer.Option


def plan_cmd(
    model: Optional[str] = typer.Argument(None, help="A preset (llama3-8b, llama3-70b, llama3.1-405b, "
                                          "qwen2.5-7b/72b, qwen3-8b/14b, mistral-7b, mixtral-8x7b, deepseek-v3, "
                                          "gpt3-175b, llama2-7b, resnet50, ...: docs/plan.md) | gpt (with "
                                          "--layers ...) | an HF config.json | pkg.mod:factory"),
    params: Optional[float] = O(None, help="Parameter count (alone: model states only; with a CNN preset: "
                                "overrides its count)."),
    layers: Optional[int] = O(None, help="GPT: transformer layers."),
    hidden: Optional[int] = O(None, help="GPT: hidden size."),
    heads: Optional[int] = O(None, help="GPT: attention heads."),
    kv_heads: Optional[int] = O(None, "--kv-heads", help="GPT: key/value heads (GQA; default = heads)."),
    ffn: Optional[int] = O(None, help="GPT: MLP inner size (default 4 x hidden)."),
    seq: Optional[int] = O(None, help="Sequence length."),
    vocab: Optional[int] = O(None, help="GPT: vocabulary size."),
    gated: Optional[bool] = O(None, "--gated/--no-gated", help="GPT: SwiGLU MLP (three matrices)."),
    experts: Optional[int] = O(None, help="MoE: routed experts per layer (with gpt --layers ...; or overrides "
                               "a preset's)."),
    top_k: Optional[int] = O(None, "--top-k", help="MoE: experts each token runs (default 1)."),
    expert_ffn: Optional[int] = O(None, "--expert-ffn", help="MoE: an expert's MLP inner size (default --ffn)."),
    capacity_factor: Optional[float] = O(None, "--capacity-factor",
                                         help="MoE: token slots per expert over the balanced share (default 1)."),
    input_shape: Optional[str] = O(None, "--input-shape",
                                   help="Input of a pkg.mod:factory model (C,H,W, or tokens:SEQ)."),
    gpu: Optional[str] = O(None, help="GPU preset (a100-80gb, h100-sxm, ...; default a100-80gb)."),
    gpus_per_node: Optional[int] = O(None, "--gpus-per-node", help="GPUs per node (default 8)."),
    nodes: Optional[int] = O(None, help="Nodes (default 1)."),
    intra: Optional[str] = O(None, help="Intra-node link: nvlink2/3/4, pcie3/4/5 (default: the GPU's usual)."),
    inter: Optional[str] = O(None, help="Network: ib-edr/hdr/ndr, roce-25/100/200/400, eth-10/25/100."),
    nics_per_node: Optional[int] = O(None, "--nics-per-node", help="NICs per node (DGX A100: 8)."),
    price: Optional[float] = O(None, help="Price per GPU-hour (for cost), in --currency."),
    currency: Optional[str] = O(None, help="Currency of --price, printed with every cost (default USD)."),
    cluster: Optional[str] = O(None, help="YAML cluster file (keys as the flags)."),
    calibration: Optional[str] = O(None, help="Calibration JSON from `tandem bench`."),
    global_batch: Optional[int] = O(None, "--global-batch", help="Samples per optimizer step (default 256)."),
    micro_batch: Optional[int] = O(None, "--micro-batch", help="Samples per GPU per forward/backward."),
    precision: Optional[str] = O(None, help="fp32 | tf32 | bf16 | fp16 | fp8 (default bf16)."),
    optimizer: Optional[str] = O(None, help="adamw | adam | sgd-momentum | sgd (default adamw)."),
    recompute: Optional[str] = O(None, help="none | selective | full."),
    efficiency: Optional[float] = O(None, help="Fraction of peak FLOP/s sustained (default: gpt 0.5, cnn 0.18)."),
    overlap: Optional[float] = O(None, help="Override: fraction of the overlap window that hides DP communication "
                                            "(0-1; default: as DDP/FSDP/ZeRO schedule it)."),
    overlap_param_gather: Optional[bool] = O(None, "--overlap-param-gather/--no-overlap-param-gather",
                                             help="ZeRO-1/2: gather updated parameters during the next forward "
                                                  "(Megatron's distributed optimizer); default: exposed."),
    grad_reduce: Optional[str] = O(None, "--grad-reduce", help="fp32 | bf16 | fp16: dtype of the data-parallel "
                                   "gradient reduction (default: fp32 for bf16 at ZeRO-1/2, as Megatron-LM; "
                                   "else the model's)."),
    pp_grad_sync: Optional[str] = O(None, "--pp-grad-sync", help="microbatch | step | round: when ZeRO-2/3 "
                                    "gradients are reduce-scattered under a pipeline (default microbatch; step: "
                                    "torch.distributed.pipelining; round: Llama 3's, once a round of the interleaved "
                                    "schedule)."),
    flash_attention: Optional[bool] = O(None, "--flash-attention/--no-flash-attention",
                                        help="Fused attention (FlashAttention/cuDNN): no s x s scores stored, "
                                             "so --recompute none keeps selective's memory (default: off, "
                                             "Korthikanti et al.'s eager attention; on for tandem's GPT and cp > 1)."),
    attention_kernel: Optional[str] = O(None, "--attention-kernel", help="unfused | fused | fa1 | triton | fa2 | fa3 | cudnn: the "
                                        "attention kernel's published speed (fused: the GPU's usual one)."),
    kernels: Optional[str] = O(None, help="fused (Megatron/NeMo/TE, default) | compiled (torch.compile) | eager: "
                               "which norms, adds, activations and loss run as separate memory-bound passes."),
    fsdp: Optional[str] = O(None, help="fsdp2 (torch's fully_shard, default) | fsdp1 (FullyShardedDataParallel): "
                            "which ZeRO-3 copies of unsharded parameters and gradients are timed."),
    runtime: Optional[str] = O(None, help="tandem (default: tandem train's FSDP2/DDP + SDPA) | torchtitan | megatron "
                               "(Megatron-core/NeMo) | megatron-2021 (before FlashAttention) | deepspeed-2021 "
                               "(ZeRO-3 gathers exposed, one 0.50 efficiency): whose rules are planned "
                               "(attention kernel, gradient dtype, ZeRO-3 prefetch, efficiency)."),
    allocator_reserve: Optional[float] = O(None, "--allocator-reserve",
                                           help="Caching allocator's reserved over allocated bytes, minus 1 (e.g. "
                                                "0.05), added to memory (default 0: tensors only)."),
    compute_time: Optional[float] = O(None, "--compute-time", help="Measured compute seconds per step per GPU."),
    dp: Optional[int] = O(None, help="Data-parallel degree (default: GPUs / (tp x pp x cp))."),
    tp: Optional[int] = O(None, help="Tensor-parallel degree."),
    pp: Optional[int] = O(None, help="Pipeline-parallel degree."),
    cp: Optional[int] = O(None, help="Context-parallel degree: ring attention over cp GPUs per sequence "
                          "(world = dp x tp x pp x cp)."),
    ep: Optional[int] = O(None, help="Expert-parallel degree (MoE): experts split over ep of the dp ranks."),
    cp_impl: Optional[str] = O(None, "--cp-impl", help="Ring attention as megatron (Megatron-core/TE p2p ring, "
                               "default), torch (torch's context_parallel, as torchtitan runs it) or allgather (Llama 3's "
                               "all-gather CP)."),
    tp_overlap: Optional[str] = O(None, "--tp-overlap", help="none (default) | bulk | ring: tensor-parallel AG/RS "
                                  "hidden behind their GEMMs (TE userbuffers' tp_comm_overlap, torch's async TP)."),
    overlap_p2p: Optional[bool] = O(None, "--overlap-p2p/--no-overlap-p2p",
                                    help="Interleaved pipeline: sends posted async and waited before use "
                                         "(Megatron-core's overlap_p2p_comm); default: blocking."),
    zero: Optional[int] = O(None, help="ZeRO stage 0-3 (3 = FSDP full shard)."),
    schedule: Optional[str] = O(None, help="Pipeline schedule: 1f1b | gpipe | interleaved."),
    virtual: Optional[int] = O(None, help="Interleaved: model chunks per stage (default 2)."),
    hsdp: Optional[bool] = O(None, "--hsdp/--no-hsdp", help="Shard inside a node, replicate across nodes."),
    stage_layers: Optional[str] = O(None, "--stage-layers",
                                    help="Layers per pipeline stage, e.g. 7,8,8,7 (default: the planner's "
                                         "balanced split, logits counted on the last stage)."),
    steps: Optional[int] = O(None, help="Training length in steps."),
    tokens: Optional[float] = O(None, help="Training length in tokens (GPT)."),
    samples: Optional[float] = O(None, help="Training length in samples (or data set size with --epochs)."),
    epochs: Optional[float] = O(None, help="Epochs over --samples."),
    ref_batch: Optional[int] = O(None, "--ref-batch", help="Batch the learning rate was tuned at."),
    warmup_steps: Optional[int] = O(None, "--warmup-steps", help="LR warm-up steps of the job."),
    threads_per_worker: Optional[int] = O(None, "--threads-per-worker",
                                          help="CPU workers: intra-op threads each (default cores / workers); "
                                               "used with a calibration's measured model."),
    config: Optional[str] = O(None, help="A tandem job spec (toml/yaml) to take the inputs from."),
    do_search: bool = O(False, "--search", help="Enumerate every valid strategy and rank them."),
    objective: str = O("time", help="Search objective: time | cost (cost also tries fewer nodes)."),
    top: int = O(5, help="Strategies shown by --search."),
    as_json: bool = O(False, "--json", help="Print JSON with stable keys (SI units)."),
    out_file: Optional[str] = O(None, "--out", help="Also write the plan (the --json document and the job it was "
                                "made for) to FILE: what `tandem train SPEC --plan FILE` runs."),
    trainable: bool = O(False, "--trainable", help="--search: rank only the layouts `tandem train` can run "
                        "(every plan is marked either way)."),
    strict: bool = O(False, "--strict", help="Exit 1 when the plan (or every searched plan) does not fit in memory."),
    plot: Optional[str] = O(None, help="Write a PNG: step time breakdown and memory per GPU."),
) -> None:
    """Predict memory, communication, step time and cost of a training strategy, and show the arithmetic."""
    # the planner imported when the verb runs, not when `tandem --help` lists it
    from rich.console import Console

    from tandem.plan.artifact import job_block, mark, refusal_of, write
    from tandem.plan.cost import evaluate, validate
    from tandem.plan.inputs.args import PlanArgs, resolve, strategy
    from tandem.plan.report import assumptions, render, to_dict
    from tandem.plan.search import default_micro_batch, reasons, search

    args = PlanArgs(**{k: v for k, v in locals().items() if k in PlanArgs.__dataclass_fields__})
    m, c, t, v = resolve(args)
    plans = []
    extra: dict = {}
    if do_search:
        if objective not in ("time", "cost"):
            raise ConfigError(f"unknown objective '{objective}'", field="objective", value=objective,
                              fix="use time or cost")
        if objective == "cost" and c.price_per_gpu_hour is None:
            raise ConfigError("--objective cost needs --price", field="price", fix="give --price per GPU-hour")
        r = search(m, c, t, objective=objective, top=top)
        refusal = refusal_of(m, c, v.get("_job"), config)
        untrained = 0
        if trainable:   # the layouts tandem trains, ranked as before
            kept = [p for p in r.ranked if not refusal(p)]
            untrained = len(r.ranked) - len(kept)
            r.ranked, r.oom = kept, [p for p in r.oom if not refusal(p)]
        plans = r.ranked[:top]
        extra = {"search": {"objective": objective, "evaluated": r.counts["evaluated"],
                            "fit": len(r.ranked), "out_of_memory": r.counts["out of memory"],
                            "seconds": r.seconds, "reasons": reasons(r, top, refusal), "runtime": t.runtime,
                            "trainable_only": trainable, "untrainable_left_out": untrained}}
        if trainable:
            what = "strategy" if untrained == 1 else "strategies"
            extra["search"]["reasons"].insert(1, f"--trainable: {untrained:,} fitting {what} tandem cannot train "
                                                 "yet left out.")
        if not plans:
            plans = r.oom[:1]
    else:
        s = strategy(v, c, t)
        validate(m, c, t, s)
        mb_auto = not v.get("micro_batch")
        if mb_auto:  # global batch / dp in one micro-batch rarely fits a large model: pick what does
            s = default_micro_batch(m, c, t, s)
        p = evaluate(m, c, t, s)
        plans = [p]
        extra["assumptions"] = assumptions(p, v["_given"], mb_auto)
        if not p.memory.fits:
            extra["suggestion"] = suggestion(m, c, t, s)
    out = [to_dict(p) for p in plans]
    for d in out:
        d["cluster"]["notes"] = list(c.notes)
    mark(out, c.gpus_per_node, v.get("_job"), config)   # trainable{ok, why}: what `tandem train --plan` runs
    if "suggestion" in extra:   # the flags that make it fit, for the train-time row (the sentence is printed below)
        sug = extra["suggestion"]
        flags = sug[sug.rfind("(--") + 1:-1] if sug.endswith(")") and "(--" in sug else None
        out[0]["train_time"]["to_fit"] = flags or "more GPUs, --tp/--pp, or --search"
    unfit = not any(p.memory.fits for p in plans)
    if plot:
        from tandem.plan.plot import plot_plans   # matplotlib, only with --plot

        plot_plans(plans, plot)
    doc = out[0] if len(out) == 1 and not do_search else {"plans": out}
    doc.update(extra)
    if out_file:   # the artifact `tandem train --plan` reads: this document and the job it was made for
        write(dict(doc, job=job_block(m, c, v.get("_job"), config)), out_file)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        _strict_exit(strict, unfit)
        return
    con = Console()
    for note in c.notes:
        con.print(f"[cyan]calibration[/]: {note}", highlight=False)
    if do_search:
        for line in extra["search"]["reasons"]:
            con.print(line, highlight=False)
        rt = out[0]["runtime"]
        con.print(f"runtime {rt['name']} ({rt['what']}): its rules for every strategy searched; --runtime to change",
                  highlight=False)
        render(out[0], con)
        _wrote(con, out_file)
        _strict_exit(strict, unfit)
        return
    render(out[0], con, extra.get("assumptions"))
    if "suggestion" in extra:
        con.print(f"[yellow]suggestion[/]: {extra['suggestion']}", highlight=False)
    _wrote(con, out_file)
    _strict_exit(strict, unfit)


def _wrote(con, out_file: str | None) -> None:
    if out_file:
        con.print(f"plan written: {out_file} (tandem train SPEC --plan {out_file} runs its winner)", highlight=False,
                  soft_wrap=True)


class DoesNotFit(TandemError):
    """--strict and no plan fits in memory (exit 1, as a failed check: the inputs were valid)."""

    exit_code = 1


def _strict_exit(strict: bool, unfit: bool) -> None:
    """--strict: a plan that cannot run is a failure, for scripts that gate a booking on it. An exception, not
    typer.Exit: `tandem` runs typer with standalone_mode=False, where an Exit's code would be dropped."""
    if strict and unfit:
        raise DoesNotFit("the plan does not fit in GPU memory", field="strict",
                         fix="apply the suggestion above, or drop --strict to see the plan anyway")


def suggestion(m, c, t, s) -> str:
    """What does fit: a smaller micro-batch (and recompute) with these degrees, else ZeRO-3, else --search."""
    from tandem.plan.search import fitting_micro_batch   # the planner, when the verb runs (plan_cmd)

    fit = fitting_micro_batch(m, c, t, s)
    if fit is not None:
        g = t.global_batch // (s.dp * fit.micro_batch)
        rc = f" --recompute {fit.recompute}" if fit.recompute != s.recompute else ""
        return (f"micro-batch {s.micro_batch} does not fit; micro-batch {fit.micro_batch} "
                f"with {g} gradient accumulation step(s){rc and ' and ' + rc.strip()} "
                f"does (--micro-batch {fit.micro_batch}{rc})")
    if s.zero < 3 and s.pp == 1:
        z3 = fitting_micro_batch(m, c, t, s.with_zero(3, c.gpus_per_node))
        if z3 is not None:
            rc = f" --recompute {z3.recompute}" if z3.recompute != "none" else ""
            return (f"no micro-batch fits with zero {s.zero}; sharding the model states over the {s.dp} "
                    f"data-parallel GPUs does (--zero 3 --micro-batch {z3.micro_batch}{rc})")
    return "no micro-batch fits with these degrees; try more GPUs, --tp/--pp, or --search"
