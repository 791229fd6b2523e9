"""The plan as JSON with stable keys (SI units: bytes, seconds, FLOP/s) and as a rich table."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from tandem.plan.cost import Plan
from tandem.plan.explain import explain, warnings
from tandem.plan.explain_comm import overlap_rule
from tandem.plan.inputs.hardware import GPU_ARCH
from tandem.plan.inputs.runtime import RUNTIMES, fused_by_default
from tandem.plan.inputs.training import fused_attention
from tandem.plan.terms.collectives import grad_reduce_bytes
from tandem.plan.terms.efficiency import FP8_OVER_BF16, arch_of, linear
from tandem.plan.terms.grad_sync import deferred
from tandem.plan.terms.pipeline import async_p2p
from tandem.plan.terms.stages import split_name
from tandem.plan.units import gib, ms, si

SCHEMA = "tandem.plan/1"
KINDS = {"gpt": "transformer", "cnn": "CNN", "net": "measured token model", "params": "bare parameter count"}


def grad_reduce(t, s) -> str | None:
    """The dtype data-parallel gradients are reduced in (collectives.grad_reduce_bytes); None without dp x cp."""
    if s.dp * s.cp <= 1:   # cp ranks reduce gradients too (cost.py: dp x cp)
        return None
    stored = t.bytes["grad"]
    gb = grad_reduce_bytes(t.precision, s.zero, stored, t.grad_reduce)
    if t.grad_reduce:
        return t.grad_reduce
    return "fp32" if gb == 4 else ("fp16" if t.precision == "fp16" else "bf16")


def to_dict(p: Plan, with_explain: bool = True) -> dict[str, Any]:
    m, c, t, s, mem = p.model, p.cluster, p.training, p.strategy, p.memory
    steps = p.steps
    # a plan that does not fit cannot run: it gets no train time and no cost (a number next to "does not fit"
    # reads as a budget); the step it would take is still in time{} for comparison
    secs = steps * p.step_s if steps and mem.fits else None
    gpu_h = secs * s.world / 3600 if secs is not None else None
    g = m.gpt
    return {
        "schema": SCHEMA,
        "model": {"name": m.name, "kind": m.kind, "params": m.params, "flops_per_sample": m.flops_per_sample,
                  "seq": g.seq if g else None, "source": m.source,
                  "moe": ({"experts": m.moe.experts, "top_k": m.moe.top_k, "expert_ffn": m.moe.expert_ffn,
                           "shared": m.moe.shared, "capacity_factor": m.moe.capacity_factor}
                          if m.moe is not None else None)},
        "cluster": {"gpu": c.gpu.name, "compute_from": (f"{c.host_model.device} workers, measured ({c.host_model.name})"
                                                         if p.host_factors else f"{c.gpu.name} preset"),
                    "gpus_per_node": c.gpus_per_node, "nodes": c.nodes, "intra": c.intra.name,
                    "inter": c.inter.name, "intra_bandwidth_Bps": c.intra.bandwidth_Bps,
                    "node_bandwidth_Bps": c.node_bandwidth_Bps, "intra_busbw_Bps": c.intra.rate_Bps,
                    "node_busbw_Bps": c.node_rate_Bps, "peak_flops": c.gpu.peak(t.precision),
                    "flops_ref": c.flops_ref(t.precision), "calibrated": bool(c.achieved_flops) or bool(c.notes),
                    "price_per_gpu_hour": c.price_per_gpu_hour, "currency": c.currency},
        "runtime": {"name": t.runtime, "what": RUNTIMES[t.runtime].what,
                    "rules": {k: src for k, src in RUNTIMES[t.runtime].sources}},
        "strategy": {"dp": s.dp, "tp": s.tp, "pp": s.pp, "cp": s.cp, "ep": s.ep, "zero": s.zero, "hsdp": s.hsdp,
                     "dp_shard": s.dims.dp_shard, "micro_batch": s.micro_batch, "global_batch": t.global_batch, "grad_accum": p.grad_accum,
                     "schedule": s.schedule, "virtual": s.virtual, "recompute": s.recompute,
                     "precision": t.precision, "optimizer": t.optimizer,
                     "flash_attention": fused_attention(t, s), "cp_impl": t.cp_impl, "kernels": t.kernels,
                     "fsdp": t.fsdp, "tp_overlap": t.tp_overlap, "pp_grad_sync": t.pp_grad_sync,
                     "overlap_p2p": t.overlap_p2p,
                     "attention_kernel": p.attn_kernel or None, "grad_reduce": grad_reduce(t, s),
                     "runtime": t.runtime},
        "memory_per_gpu": {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                           "activations": mem.activations, "other": mem.other, "reserve": mem.reserve,
                           "total": mem.total,
                           "capacity": mem.capacity, "fits": mem.fits},
        "comm": [{"name": o.name, "collective": o.collective, "bytes": o.bytes, "calls": o.calls,
                  "group_size": o.group.size, "nodes_spanned": o.group.nodes, "link": o.link,
                  "time_s": o.time_s, "exposed_s": o.exposed_s, "chunks": o.chunks, "algorithm": o.algorithm,
                  "overlap": o.rule} for o in p.comm],
        "time": {"compute_s": p.compute_s, "comm_s": p.comm_s, "exposed_comm_s": p.exposed_comm_s,
                 "bubble_s": p.bubble_s, "step_s": p.step_s, "efficiency": p.efficiency,
                 "serial_comm_share": p.serial_comm_share,
                 "compute_measured": p.compute_measured, "attn_s": p.attn_s, "mem_bound_s": p.mem_bound_s,
                 "optimizer_s": p.optimizer_s, "cp_merge_s": p.cp_merge_s, "fsdp_copy_s": p.fsdp_copy_s,
                 "bubble_comm_s": p.bubble_comm_s,
                 "host_core_slowdown": p.host_factors[0] if p.host_factors else None,
                 "host_straggler_factor": p.host_factors[1] if p.host_factors else None},
        "throughput": {"samples_per_s": p.samples_per_s,
                       "tokens_per_s": p.samples_per_s * g.seq if g else None,
                       "tflops_per_gpu": p.tflops_per_gpu, "mfu": p.mfu},
        "scaling": {"speedup_vs_1gpu": p.speedup, "efficiency": p.speedup / s.world if s.world else None},
        "train_time": {"steps": steps, "seconds": secs, "gpu_hours": gpu_h,
                       "cost": gpu_h * c.price_per_gpu_hour if gpu_h is not None and c.price_per_gpu_hour
                       is not None else None, "currency": c.currency,
                       "fits": mem.fits, "to_fit": None},   # to_fit: the CLI's suggestion, when it does not fit
        "warnings": warnings(p),
        "explain": explain(p) if with_explain else [],
    }


def render(d: dict[str, Any], console, assumed: list[str] | None = None) -> None:
    st, tm, mem, th = d["strategy"], d["time"], d["memory_per_gpu"], d["throughput"]
    cl = d["cluster"]  # compute measured on this host's workers: the GPU preset then only sets memory limits
    if cl["gpu"] == "cpu":  # a CPU cluster from a calibration: its workers, the host's RAM shared
        who = "cpu workers" if cl["compute_from"].endswith("preset") else cl["compute_from"]
    else:
        who = cl["gpu"] if cl["compute_from"].endswith("preset") else f"{cl['compute_from']}; memory of {cl['gpu']}"
    links = cl["intra"] if cl["nodes"] == 1 else f"{cl['intra']} / {cl['inter']}"
    title = f"{d['model']['name']} on {cl['nodes']}x{cl['gpus_per_node']} {who} ({links})"
    tab = Table(title=title, show_header=True, header_style="bold")
    tab.add_column("quantity")
    tab.add_column("value", justify="right")
    rows = [
        ("strategy", f"dp {st['dp']} tp {st['tp']} pp {st['pp']}"
                     + (f" cp {st['cp']}" if st['cp'] > 1 else "") + (f" ep {st['ep']}" if st['ep'] > 1 else "")
                     + f" zero {st['zero']} mb {st['micro_batch']} "
                     f"x{st['grad_accum']} acc, {st['precision']}, recompute {st['recompute']}"),
    ]
    if d.get("trainable"):  # artifact.mark: whether `tandem train --plan` can run this layout
        tr = d["trainable"]
        rows.append(("tandem train", "yes (--out FILE, then tandem train SPEC --plan FILE)" if tr["ok"]
                     else f"[red]cannot train it yet[/]: {tr['why']}"))
    rows += [
        ("memory / GPU", f"{gib(mem['total'])} of {gib(mem['capacity'])} "
                         f"({'fits' if mem['fits'] else '[red]does not fit[/]'})"),
        ("  params | grads | optim", f"{gib(mem['params'])} | {gib(mem['grads'])} | {gib(mem['optimizer'])}"),
        ("  activations | other", f"{gib(mem['activations'])} | {gib(mem['other'])}"),
        ("compute", ms(tm["compute_s"])),
        ("communication (exposed)", f"{ms(tm['comm_s'])} ({ms(tm['exposed_comm_s'])})"),
        ("pipeline bubble", ms(tm["bubble_s"])),
        ("step", f"[bold]{ms(tm['step_s'])}[/]"),
        ("samples/s", f"{th['samples_per_s']:,.1f}"),
    ]
    if th["tokens_per_s"]:
        rows.append(("tokens/s", f"{th['tokens_per_s']:,.0f}"))
    rows.append(("TFLOP/s per GPU (MFU)", f"{th['tflops_per_gpu']:.1f} ({th['mfu']:.1%})"))
    sc = d["scaling"]
    rows.append(("speedup vs 1 GPU", f"{sc['speedup_vs_1gpu']:.2f}x ({sc['efficiency']:.0%})"))
    tt = d["train_time"]
    if tt["steps"] and not tt["fits"]:
        rows.append(("train time", "[red]does not fit: no time/cost[/]"
                     + (f" (to fit: {tt['to_fit']})" if tt.get("to_fit") else "")))
    elif tt["seconds"]:
        cost = f", cost {tt['currency']} {tt['cost']:,.0f}" if tt["cost"] is not None else ""
        rows.append(("train time", f"{tt['steps']:,} steps, {tt['seconds'] / 3600:,.1f} h, "
                                   f"{tt['gpu_hours']:,.0f} GPU-h{cost}"))
    for k, v in rows:
        tab.add_row(k, v)
    console.print(tab)
    if assumed:
        console.print("assumed: " + "; ".join(assumed), highlight=False)
    if d["comm"]:
        ct = Table(show_header=True, header_style="bold", title="communication per step")
        for col in ("name", "collective", "bytes", "calls", "group", "link", "time", "exposed"):
            ct.add_column(col, justify="right" if col not in ("name", "collective", "link") else "left")
        for o in d["comm"]:
            ct.add_row(o["name"], o["collective"], si(o["bytes"]), str(o["calls"]), str(o["group_size"]),
                       o["link"], ms(o["time_s"]), ms(o["exposed_s"]))
        console.print(ct)
    for w in d["warnings"]:
        console.print(f"[yellow]warning[/]: {w}", highlight=False)
    for line in d["explain"]:
        console.print(f"  {line}", highlight=False)


def assumptions(p: Plan, given: set[str], mb_auto: bool) -> list[str]:
    """The inputs that decide the answer, each marked as given or as the planner's default (and its flag)."""
    c, t, s = p.cluster, p.training, p.strategy

    def how(flag: str, default_why: str) -> str:
        return "given" if flag in given else f"{default_why}; --{flag.replace('_', '-')} to change"

    rt = RUNTIMES[t.runtime]
    out = [f"micro-batch {s.micro_batch} x {p.grad_accum} accumulation ("
           + (("the largest that fits" if p.memory.fits else "none fits: the smallest") if mb_auto else "given") + ")"]
    if c.nodes > 1 and not c.inter.name.endswith("(measured)"):
        out.append(f"{c.nics_per_node} x {c.inter.name} NIC(s) per node = {c.node_bandwidth_Bps / 1e9:.3g} GB/s "
                   f"({how('nics_per_node', 'default')})")
    if p.comm and t.overlap is not None:
        out.append(f"overlap {t.overlap:g} of DP communication hidden (given)")
    elif any(o.rule != "none" or o.name.startswith(("dp", "fsdp", "hsdp")) for o in p.comm):
        out.append(f"overlap {overlap_rule(p)} (default; --overlap F to override)")
    tp = next((o for o in p.comm if o.name == "tp-activations"), None)
    if tp is not None:
        why = how("tp_overlap", "default, as torch without async TP and Megatron-LM before August 2021 run it; "
                                "Megatron-LM since March 2022: bulk")
        line = f"tensor-parallel communication: overlap {t.tp_overlap} ({why}: none|bulk|ring)"
        if t.tp_overlap != "none" and tp.group.nodes > 1:   # tensor_parallel.tp_op charges it as none
            line += (f", but the tp group spans {tp.group.nodes} nodes: charged in full (userbuffers / symmetric "
                     "memory need one NVLink domain)")
        out.append(line)
    pp = next((o for o in p.comm if o.name == "pp-p2p"), None)
    if pp is not None:
        if async_p2p(t, s, p.grad_accum):
            out.append("pipeline sends async, waited before use (--overlap-p2p given: Megatron-core's "
                       "overlap_p2p_comm)")
        elif not t.overlap_p2p:
            why = ("--no-overlap-p2p given" if "overlap_p2p" in given else
                   "default, as Megatron-LM without overlap_p2p_comm" + (
                       "; --overlap-p2p for Megatron-core's async sends" if s.schedule == "interleaved" else ""))
            out.append(f"pipeline sends blocking ({why})")
        else:
            why = ("it needs the interleaved schedule" if s.schedule != "interleaved" or s.virtual < 2 else
                   f"m = {p.grad_accum} <= p = {s.pp}: every chunk forward is warm-up, no steady state")
            out.append(f"pipeline sends blocking (--overlap-p2p given, but {why}: it has no effect)")
    elif t.overlap_p2p and "overlap_p2p" in given:
        out.append("--overlap-p2p given, but pp 1 (no pipeline sends): it has no effect")
    if "fsdp" in given and s.zero < 3:
        out.append(f"--fsdp {t.fsdp} given, but zero {s.zero} < 3: no FSDP runs, so it has no effect")
    if "pp_grad_sync" in given and t.pp_grad_sync != "microbatch" and not (deferred(t, s) and p.model.moe is None
                                                                          and p.model.gpt is not None):
        why = (f"zero {s.zero} < 2 (no sharded gradients)" if s.zero < 2 else "pp 1 (no pipeline)" if s.pp == 1
               else "an MoE model (reduced per micro-batch: not modelled)" if p.model.moe is not None
               else "no layer shapes (a bare --params model)")
        out.append(f"--pp-grad-sync {t.pp_grad_sync} given, but {why}: it has no effect")
    if p.stage_layers:
        out.append(f"pipeline stages of {','.join(map(str, p.stage_layers))} layers, embedding first, logits last "
                   f"({split_name(s, p.model.gpt)}{'' if s.stage_layers else '; --stage-layers to change'})")
    if p.attn_bf16_s:
        out.append("fp8 on the linear layers only, attention at the bf16 rate (Transformer Engine default)")
    if p.linear_share < 0.9995:
        out.append(f"linear layers at {p.linear_share:.3g} of the rate: per GEMM the slower of their shape "
                   f"(tiles {p.gemm_shape:.3g}, measured GEMM speeds) and memory (roofline {p.gemm_roofline:.3g})")
    if p.fp8_cast_s:
        out.append("fp8 casts of each linear layer's input and gradient timed at the memory bandwidth")
    if p.compute_measured:
        out.append("compute time measured (--compute-time)")
    elif p.host_factors:
        out.append("compute from this model's measured FLOP/s (calibration)")
    else:
        ref = "calibrated" if t.precision in c.achieved_flops else "datasheet peak"
        arch = arch_of(c.gpu.name) if linear(c.gpu.name, p.model.kind) else None
        fp8 = f" x {FP8_OVER_BF16:.3f} for FP8" if t.precision == "fp8" and p.model.kind == "gpt" else ""
        why = (f"the {arch.arch} figure for a transformer's linear layers{fp8}, efficiency.py" if arch else
               "default for a " + KINDS.get(p.model.kind, p.model.kind) + fp8
               + (", an end-to-end figure" if p.model.kind == "params" else ""))
        if t.runtime_efficiency:
            why = f"{rt.name}'s one end-to-end share for every FLOP, runtime.py"
        out.append(f"efficiency {p.efficiency:.2f} of {ref} {t.precision} FLOP/s ({how('efficiency', why)})")
    if p.attn_s and t.efficiency is None and p.attn_kernel:
        if "attention_kernel" in given or "flash_attention" in given:
            why = "given"
        elif s.cp > 1:
            why = "ring attention runs fused kernels"
        elif fused_by_default(rt, GPU_ARCH.get(c.gpu.name)) and t.flash_attention:
            why = (f"default: the fused kernel {rt.name} runs on {c.gpu.name}; --attention-kernel unfused for eager "
                   "attention (2021), or --runtime megatron-2021")
        else:
            why = "default; --attention-kernel unfused|fused|fa1|triton|fa2|fa3|cudnn to change"
        out.append(f"attention kernel {p.attn_kernel} at {p.attn_ratio:.3g} of the linear layers' rate ({why})")
    gr = grad_reduce(t, s)
    if gr is not None:
        why = ("given" if "grad_reduce" in given else
               f"default, as {rt.name} reduces 16-bit gradients" if rt.grad_reduce and t.grad_reduce == rt.grad_reduce
               else "default: FP32 for BF16 at ZeRO-1/2 (Megatron's distributed optimizer), else the gradients' dtype")
        out.append(f"data-parallel gradients reduced in {gr} ({why}; --grad-reduce fp32|bf16|fp16 to change)")
    out.append(f"runtime {rt.name}, {rt.what} (" + ("given" if "runtime" in given else
                                                f"default; --runtime {'|'.join(RUNTIMES)} to change") + ")")
    return out
