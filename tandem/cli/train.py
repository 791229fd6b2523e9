"""`tandem train CONFIG [--section.key VALUE ...]`: the spec and overrides in, the run (train/run.py), the result out."""

from __future__ import annotations

import json

import typer

from tandem.cli.passthrough import refuse_unknown_flags, refuse_unknown_option
from tandem.core import rundir
from tandem.core.config import load_spec
from tandem.core.console import make_console
from tandem.train.run import AlreadyComplete, print_result, run_dir_of, run_training


def split_flags(args: list[str], names: tuple[str, ...]) -> tuple[list[str], set[str]]:
    """Our own flags may come after CONFIG, among the overrides: take them out."""
    return [a for a in args if a not in names], {a for a in args if a in names}


def train_cmd(
    ctx: typer.Context,
    config: str = typer.Argument(..., help="Job spec (.toml or .yaml); see `tandem spec` for every field."),
    stream: bool = typer.Option(False, "--stream", help="Stream every rank's output (rank-prefixed) "
                                                        "instead of a progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    fresh: bool = typer.Option(False, "--fresh", help="Start over: move the run dir's previous run aside "
                                                      "(RUN_DIR.<time>), then train from step 0."),
) -> None:
    """Train the job in CONFIG; override any field with --section.key VALUE.

    Example: tandem train examples/digits_resnet.toml --launch.simulate_nodes 2 --launch.nproc_per_node 2
    """
    refuse_unknown_option(ctx, config, "train", after="CONFIG")
    overrides, flags = split_flags(ctx.args, ("--json", "--stream", "--fresh"))
    refuse_unknown_flags(ctx, overrides, "train")  # `tandem train x.toml --jsn`: a typo of ours, not an override
    as_json, stream, fresh = as_json or "--json" in flags, stream or "--stream" in flags, fresh or "--fresh" in flags
    spec = load_spec(config, overrides)
    console = make_console(stderr=as_json)
    try:
        result = run_training(spec, console, stream=stream, fresh=fresh)
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
