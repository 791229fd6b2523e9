"""The plan artifact between `tandem plan --out plan.json` and `tandem train SPEC --plan plan.json`.

The file is the plan's JSON document (`--json`, schema tandem.plan/1) with a ``job`` block: the model
shape and world size the plan was made for, so that the trainer can refuse a plan made for another
job. The winner (the first plan) maps to job-spec overrides here, in one place:

    dp            derived by the trainer (world / (tp x pp x cp)); checked against the plan's
    tp, pp, cp    parallel.tp, parallel.pp, parallel.cp
    ep            parallel.ep (once the trainer's spec has it; until then the layout is refused)
    zero, hsdp    parallel.strategy ddp | zero1 | zero2 | zero3 | hsdp (+ parallel.dp_shard)
    micro_batch   schedule.micro_batch, global_batch schedule.global_batch (accumulation follows)
    recompute     parallel.activation_checkpoint none | full (the planner's selective has no twin)
    schedule      parallel.pp_schedule, virtual parallel.pp_virtual (with pp > 1)

Whether tandem can train a layout is ``untrainable``: ParallelDims.trainer_refusal (the degrees), the
recompute rule above and, with the job spec at hand, the trainer's own spec checks (from_spec).
`tandem plan --search` marks every candidate with it; `tandem train --plan` refuses with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.core.config import apply_overrides, from_dict, read_file
from tandem.core.decoder import DECODERS, ffn_size
from tandem.core.dims import STAGE_NAME, ParallelDims
from tandem.core.errors import ConfigError
from tandem.core.spec import ModelSpec, ParallelSpec
from tandem.core.validate import node_counts

ARTIFACT = "tandem.plan-artifact/1"
SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab", "experts")


def spec_shape(spec) -> dict[str, Any]:
    """The model shape a plan must match: a decoder's sizes, else the model's name."""
    m = spec.model
    if m.name not in DECODERS:
        return {"name": m.name}
    return {"name": m.name, "layers": m.layers, "hidden": m.hidden, "heads": m.heads,
            "kv_heads": m.kv_heads or m.heads, "ffn": ffn_size(m), "seq": m.seq, "vocab": m.vocab,
            "experts": getattr(m, "experts", 0) or 0}


def stats_shape(m) -> dict[str, Any]:
    """The same shape from the planner's model (a preset or a `gpt --layers ...` shape)."""
    g = getattr(m, "gpt", None)
    if g is None:
        return {"name": m.name}
    moe = getattr(m, "moe", None)
    return {"name": m.name, "layers": g.layers, "hidden": g.hidden, "heads": g.heads,
            "kv_heads": g.kv_heads or g.heads, "ffn": g.ffn, "seq": g.seq, "vocab": g.vocab,
            "experts": moe.experts if moe is not None else 0}


def job_block(m, c, job=None, config: str | None = None) -> dict[str, Any]:
    """What the plan was made for: the job spec's model shape (or the planner's), and the world."""
    return {"config": config, "model": spec_shape(job) if job is not None else stats_shape(m),
            "world": c.world, "gpus_per_node": c.gpus_per_node, "nodes": c.nodes}


def write(doc: dict, path: str | Path) -> Path:
    """The artifact, whole or not at all."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps({"artifact": ARTIFACT, **doc}, indent=1))
    tmp.replace(p)
    return p


def load(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("no such file", field="plan", value=str(path),
                          fix="write one with `tandem plan --config SPEC --out plan.json` (or --search --out)")
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"not a JSON plan ({e})", field="plan", value=str(path),
                          fix="give the file `tandem plan ... --out FILE` wrote") from None
    if doc.get("artifact") != ARTIFACT or "job" not in doc:
        raise ConfigError(f"not a tandem plan artifact (artifact {doc.get('artifact')!r})", field="plan",
                          value=str(path), fix="write it with `tandem plan ... --out FILE` (--json output has no "
                                               "job block)")
    return doc


def winner(doc: dict) -> dict:
    """The plan `tandem train --plan` takes: a single plan, or the first (best) of a search."""
    plans = doc.get("plans")
    return plans[0] if plans else doc


def label(s: dict) -> str:
    parts = [f"dp{s['dp']}", f"tp{s['tp']}", f"pp{s['pp']}"] + [f"{k}{s[k]}" for k in ("cp", "ep") if s.get(k, 1) > 1]
    parts += [f"z{s['zero']}" + ("-hsdp" if s.get("hsdp") else ""), f"mb{s['micro_batch']}"]
    if s["pp"] > 1:
        parts.append(s["schedule"] + (f"-v{s['virtual']}" if s["schedule"] == "interleaved" else ""))
    if s.get("recompute", "none") != "none":
        parts.append(f"rc-{s['recompute']}")
    return " ".join(parts)


def layout_overrides(s: dict, gpus_per_node: int) -> tuple[dict[str, Any], str | None]:
    """A plan's strategy{} (its JSON keys) -> ({"section.key": value} for the job spec, why it cannot be
    trained or None)."""
    dims = ParallelDims.from_degrees(s["dp"], s["tp"], s["pp"], s["zero"], bool(s.get("hsdp")), gpus_per_node,
                                     s.get("cp", 1), s.get("ep", 1))
    why = dims.trainer_refusal()
    if why:
        return {}, why
    if s.get("recompute", "none") == "selective":
        return {}, ("recompute selective: the planner's (attention scores recomputed) has no trainer twin "
                    "(parallel.activation_checkpoint selective checkpoints whole blocks)")
    ov: dict[str, Any] = {"parallel.strategy": dims.strategy if dims.strategy == "hsdp" else STAGE_NAME[dims.zero],
                          "parallel.tp": dims.tp, "parallel.pp": dims.pp, "parallel.cp": dims.cp,
                          "schedule.micro_batch": s["micro_batch"], "schedule.global_batch": s["global_batch"],
                          "parallel.activation_checkpoint": s.get("recompute", "none")}
    if "ep" in ParallelSpec.__dataclass_fields__:
        ov["parallel.ep"] = dims.ep
    if dims.strategy == "hsdp":   # the plan's shard group (a job spec's own dp_shard included), else the planner's
        ov["parallel.dp_shard"] = s.get("dp_shard") or dims.dp_shard
    if dims.pp > 1:
        ov["parallel.pp_schedule"] = s["schedule"]
        if s["schedule"] == "interleaved":
            ov["parallel.pp_virtual"] = s["virtual"]
    return ov, None


def job_refusal(data: dict, ov: dict[str, Any]) -> str | None:
    """The trainer's own spec checks (validate -> ParallelDims.from_spec) on the job spec ``data`` (its raw
    dict, read once) with the layout ``ov`` applied: the first refusal, as its one line, or None."""
    import copy

    from tandem.core.validate import validate

    try:
        validate(from_dict(apply_overrides(copy.deepcopy(data), {k: str(v) for k, v in ov.items()})))
    except ConfigError as e:   # the trainer's line, without its fix (that is for a spec, not a plan)
        return f"{e.field}: {e.message}" if e.field else e.message
    return None


def untrainable(s: dict, gpus_per_node: int, job_data: dict | None = None, model_name: str | None = None
                ) -> str | None:
    """Why tandem cannot train the plan strategy ``s`` (JSON keys), or None. ``job_data``: the raw job spec
    the plan was made from (its checks then apply too); ``model_name``: a plan without one, whose model the
    trainer must have (an MoE model needs model.experts)."""
    ov, why = layout_overrides(s, gpus_per_node)
    if why:
        return why
    if job_data is not None:
        return job_refusal(job_data, ov)
    if model_name is not None and s.get("_moe") and "experts" not in ModelSpec.__dataclass_fields__:
        return f"model {model_name}: a mixture of experts; the trainer has no MoE model yet"
    return None


def mark(plans: list[dict], gpus_per_node: int, job=None, config: str | None = None) -> None:
    """Add ``trainable{ok, why}`` to every plan of a document (`tandem plan`'s JSON and table). With the job
    spec the plan was made from (on its own world size), the trainer's spec checks apply too."""
    data = read_file(config) if config and job is not None else None
    for d in plans:
        s = dict(d["strategy"], _moe=d["model"].get("moe") is not None)
        same_world = job is not None and d["strategy"]["dp"] * d["strategy"]["tp"] * d["strategy"]["pp"] * \
            d["strategy"]["cp"] == node_counts(job.launch).max * job.launch.nproc_per_node
        why = untrainable(s, gpus_per_node, data if same_world else None, d["model"]["name"])
        d["trainable"] = {"ok": why is None, "why": why}


def refuse_other_job(doc: dict, spec, path: str) -> None:
    """One line when the plan was made for another model shape or another world size than this job's."""
    job = doc["job"]
    have = spec_shape(spec)
    want = job["model"]
    if "layers" in want and "layers" in have:
        diff = [k for k in SHAPE_KEYS if want.get(k) is not None and want.get(k) != have.get(k)]
        if diff:
            got = ", ".join(f"{k} {want[k]}" for k in diff)
            mine = ", ".join(f"{k} {have[k]}" for k in diff)
            raise ConfigError(f"the plan was made for another model shape ({got}); this job's model has {mine}",
                              field="plan", value=path, fix="plan this spec: tandem plan --config SPEC --out FILE "
                                                            "(or train the spec the plan was made for)")
    elif want.get("name") != have.get("name"):
        raise ConfigError(f"the plan was made for model {want.get('name')!r}; this job's model is "
                          f"{have.get('name')!r}", field="plan", value=path,
                          fix="plan this spec: tandem plan --config SPEC --out FILE")
    world = node_counts(spec.launch).max * spec.launch.nproc_per_node
    if job["world"] != world:
        raise ConfigError(f"the plan was made for world size {job['world']} ({job['nodes']} node(s) x "
                          f"{job['gpus_per_node']}); this job has {world} ({node_counts(spec.launch).max} node(s) "
                          f"x {spec.launch.nproc_per_node})", field="plan", value=path,
                          fix="plan for this job's world (tandem plan --config SPEC --out FILE), or give the job the "
                              "plan's --launch.nproc_per_node / --launch.nnodes")


def spec_overrides(doc: dict, path: str) -> tuple[dict[str, Any], dict]:
    """The winner's layout as job-spec overrides, and the winner; one line when tandem cannot train it."""
    w = winner(doc)
    ov, why = layout_overrides(w["strategy"], doc["job"]["gpus_per_node"])
    if why:
        better = ""
        if doc.get("plans"):
            k = next((i for i, d in enumerate(doc["plans"]) if (d.get("trainable") or {}).get("ok")), None)
            if k is not None:
                better = f"; plan #{k + 1} ({label(doc['plans'][k]['strategy'])}) is one tandem trains"
        raise ConfigError(f"the plan's winner {label(w['strategy'])} is a layout tandem cannot train: {why}{better}",
                          field="plan", value=path,
                          fix="plan again with --trainable (the search keeps what tandem trains), or give the "
                              "layout by hand (--parallel.*)")
    return ov, w


def strategy_keys(p) -> dict[str, Any]:
    """A Plan's strategy in its JSON keys (report.to_dict's strategy{}), without the whole document."""
    s = p.strategy
    return {"dp": s.dp, "tp": s.tp, "pp": s.pp, "cp": s.cp, "ep": s.ep, "zero": s.zero, "hsdp": s.hsdp,
            "dp_shard": s.dims.dp_shard, "micro_batch": s.micro_batch, "global_batch": p.training.global_batch,
            "schedule": s.schedule,
            "virtual": s.virtual, "recompute": s.recompute}


def refusal_of(m, c, job=None, config: str | None = None):
    """``refusal(plan) -> why or None`` for the search's plans on cluster ``c`` (memoised per layout)."""
    data = read_file(config) if config and job is not None else None
    world = node_counts(job.launch).max * job.launch.nproc_per_node if job is not None else None
    memo: dict = {}

    def refusal(p) -> str | None:
        s = dict(strategy_keys(p), _moe=getattr(m, "moe", None) is not None)
        key = tuple(sorted(s.items())) + (p.cluster.gpus_per_node,)
        if key not in memo:
            memo[key] = untrainable(s, p.cluster.gpus_per_node, data if p.cluster.world == world else None, m.name)
        return memo[key]
    return refusal
