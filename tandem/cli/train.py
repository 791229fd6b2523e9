"""`tandem train CONFIG [--section.key VALUE ...]`: the spec and overrides in, the run (train/run.py), the result out."""

from __future__ import annotations

import json

import typer

from tandem.cli.passthrough import refuse_unknown_flags, refuse_unknown_option
from tandem.core import rundir
from tandem.core.config import load_spec, parse_overrides
from tandem.core.errors import ConfigError
from tandem.core.console import make_console
from tandem.train.run import AlreadyComplete, print_result, run_dir_of, run_training


def split_flags(args: list[str], names: tuple[str, ...]) -> tuple[list[str], set[str]]:
    """Our own flags may come after CONFIG, among the overrides: take them out."""
    return [a for a in args if a not in names], {a for a in args if a in names}


def take_value(args: list[str], name: str) -> tuple[list[str], str | None]:
    """Our own valued flag among the overrides (``--plan FILE`` or ``--plan=FILE``): take it out."""
    out, val, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a == name:
            if i + 1 >= len(args):
                raise ConfigError("missing value", field=name.lstrip("-"), fix=f"write {name} FILE")
            val, i = args[i + 1], i + 2
            continue
        if a.startswith(name + "="):
            val = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return out, val


def with_plan(config: str, overrides: list[str], plan_path: str, console) -> tuple[object, dict]:
    """The job spec with the plan's winner layout (plan/artifact.py) under the command line's overrides;
    refused in one line, before any process starts, when the plan is for another model shape or world size,
    or its layout is one tandem cannot train. Returns the spec and what RUN_DIR/from_plan.json keeps."""
    from tandem.plan import artifact

    doc = artifact.load(plan_path)
    given = parse_overrides(overrides)
    base = load_spec(config, given, check=False)
    artifact.refuse_other_job(doc, base, plan_path)
    layout, win = artifact.spec_overrides(doc, plan_path)
    from_plan = {k: v for k, v in layout.items() if k not in given}
    spec = load_spec(config, {**{k: str(v) for k, v in from_plan.items()}, **given})
    kept = [f"{k} {given[k]}" for k in layout if k in given]
    st = win["strategy"]
    console.print(f"from plan {plan_path} ({artifact.label(st)}, dp {st['dp']} x {st['grad_accum']} accumulation): "
                  + ", ".join(f"{k} {v}" + (f" (spec: {was})" if str(was := _get(base, k)) != str(v) else "")
                              for k, v in from_plan.items())
                  + (f"; kept from the command line: {', '.join(kept)}" if kept else ""), highlight=False,
                  soft_wrap=True)
    mem = win["memory_per_gpu"]
    if not mem["fits"]:
        console.print(f"note: the plan does not fit in its {win['cluster']['gpu']}'s memory ({mem['total'] / 2**30:.3g} "
                      f"of {mem['capacity'] / 2**30:.3g} GiB); training it as asked", highlight=False, soft_wrap=True)
    return spec, {**win, "job": doc["job"], "source": str(plan_path), "applied": from_plan,
                  "kept_from_command_line": {k: given[k] for k in layout if k in given}}


def _get(spec, key: str):
    sec, name = key.split(".", 1)
    return getattr(getattr(spec, sec), name)


def train_cmd(
    ctx: typer.Context,
    config: str = typer.Argument(..., help="Job spec (.toml or .yaml); see `tandem spec` for every field."),
    stream: bool = typer.Option(False, "--stream", help="Stream every rank's output (rank-prefixed) "
                                                        "instead of a progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    fresh: bool = typer.Option(False, "--fresh", help="Start over: move the run dir's previous run aside "
                                                      "(RUN_DIR.<time>), then train from step 0."),
    plan: str = typer.Option(None, "--plan", help="A plan from `tandem plan ... --out FILE`: train its winner's "
                                                  "layout (degrees, ZeRO stage, micro-batch, recompute, schedule); "
                                                  "kept in RUN_DIR/from_plan.json for `tandem diagnose`."),
) -> None:
    """Train the job in CONFIG; override any field with --section.key VALUE.

    Example: tandem train examples/digits_resnet.toml --launch.simulate_nodes 2 --launch.nproc_per_node 2
    """
    refuse_unknown_option(ctx, config, "train", after="CONFIG")
    overrides, flags = split_flags(ctx.args, ("--json", "--stream", "--fresh"))
    overrides, plan_after = take_value(overrides, "--plan")
    plan = plan_after or plan
    refuse_unknown_flags(ctx, overrides, "train")  # `tandem train x.toml --jsn`: a typo of ours, not an override
    as_json, stream, fresh = as_json or "--json" in flags, stream or "--stream" in flags, fresh or "--fresh" in flags
    console = make_console(stderr=as_json)
    from_plan = None
    if plan:
        spec, from_plan = with_plan(config, overrides, plan, console)
    else:
        spec = load_spec(config, overrides)
    try:
        result = run_training(spec, console, stream=stream, fresh=fresh,
                              run_files={rundir.FROM_PLAN: json.dumps(from_plan, indent=1)} if from_plan else None)
    except AlreadyComplete as e:
        old = e.run_dir / rundir.RESULT
        if as_json and old.is_file():
            print(old.read_text())
        console.print(f"{e} (result: {old if old.is_file() else 'n/a'}). To train it again from the start: "
                      "--fresh; to train longer: raise --schedule.epochs or --schedule.max_steps", highlight=False,
                      soft_wrap=True)
        return
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        print_result(result, run_dir_of(spec), console)
