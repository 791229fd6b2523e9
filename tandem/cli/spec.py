"""`tandem spec [CONFIG] [--section.key VALUE ...]`: show every spec field, or a resolved, validated spec."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from tandem.cli.passthrough import overrides_first, refuse_unknown_flags, refuse_unknown_option
from tandem.core.config import field_docs, load_spec, to_dict
from tandem.core.console import make_console


def spec_cmd(
    ctx: typer.Context,
    config: Optional[str] = typer.Argument(None, help="A job spec (.toml/.yaml) to resolve and validate."),
    as_json: bool = typer.Option(False, "--json", help="Print the resolved spec as JSON."),
) -> None:
    """List the job spec's fields with their help, or validate CONFIG (with overrides) and print it.

    Example: tandem spec examples/digits_resnet.toml --schedule.global_batch 1000
    """
    args = list(ctx.args)
    if overrides_first(config, args):  # overrides of the defaults: no CONFIG
        config, args = None, [config, *args]
    elif config is not None:
        refuse_unknown_option(ctx, config, "spec", after="CONFIG")  # `tandem spec --jsn x.toml`
    if config is None and not args:
        table = Table(title="Job spec fields (set in TOML/YAML or as --section.key VALUE)")
        for col in ("key", "type", "default", "help"):
            table.add_column(col, overflow="fold")
        for key, tp, default, help_ in field_docs():
            table.add_row(key, tp, repr(default), help_)
        make_console().print(table)
        return
    overrides = [a for a in args if a != "--json"]
    as_json = as_json or "--json" in args
    refuse_unknown_flags(ctx, overrides, "spec")  # `tandem spec x.toml --jsn`
    spec = load_spec(config, overrides)
    if as_json:
        print(json.dumps(to_dict(spec), indent=2))
        return
    from tandem.core.dims import from_spec
    from tandem.core.validate import effective_lr, grad_accum, world_sizes
    from tandem.train.preflight import check_job

    check_job(spec, quick=True)  # what `tandem train` checks before launching, but the checkpoint

    lo, hi = world_sizes(spec.launch)
    make_console().print(f"[green]valid[/]: {config or '(defaults)'}; workers {lo}{'' if lo == hi else f'..{hi}'}, "
                    f"grad accumulation {grad_accum(spec, from_spec(spec, hi, warn=False).dp)}, effective lr {effective_lr(spec):g}", highlight=False)
