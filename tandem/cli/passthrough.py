"""Verbs that hand what follows their first argument (a script, a spec's overrides) to someone else.

Their context settings let click stop at that argument and keep the rest, torchrun-style: options
before it are the verb's, everything after it (or after `--`) is the script's. The price is that
click also keeps an option it does not know, and with interspersed args off the first such word
lands in the positional slot: `tandem launch --nproc-per-nodes 2 x.py` would run a "script" named
--nproc-per-nodes. refuse_unknown_option turns that into the one-line error every other verb gives.
"""

from __future__ import annotations

import difflib

import typer

from tandem.core.errors import ConfigError

# allow_extra_args + ignore_unknown_options keep the script's words (its own --flags included) for ctx.args;
# allow_interspersed_args=False stops option parsing at the first positional, so a script's `--nproc-per-node 3`
# reaches the script instead of being taken as ours.
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False}


def refuse_unknown_option(ctx: typer.Context, first: str, verb: str, *, allowed: tuple[str, ...] = (),
                          after: str = "SCRIPT") -> None:
    """Refuse `first` (the verb's positional argument as click filled it) when it is an option we lack."""
    if not first.startswith("-") or first == "-" or first in allowed:
        return
    name = first.split("=", 1)[0]
    known = sorted({o for p in ctx.command.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))
                    if o.startswith("-")})
    if "." in name:  # --section.key: a spec override, which belongs after the spec
        fix = f"a spec override goes after {after}: tandem {verb} {after} {name} VALUE"
    else:
        near = difflib.get_close_matches(name, known, n=1)
        rest = ("spec overrides are written --section.key VALUE, after CONFIG" if after == "CONFIG" else
                f"the {after}'s own options go after it (or after --)")
        fix = f"did you mean {near[0]}?" if near else f"see `tandem {verb} --help`; {rest}"
    raise ConfigError(f"no such option of tandem {verb}", field=name, fix=fix)


def refuse_unknown_flags(ctx: typer.Context, overrides: list[str], verb: str, *, after: str = "CONFIG") -> None:
    """The words after CONFIG are spec overrides, ``--section.key VALUE``: a flag there without a dot is
    no override, but one of the verb's options misspelt (`tandem spec x.toml --jsn`), refused as such."""
    i = 0
    while i < len(overrides):
        a = overrides[i]
        key = a.split("=", 1)[0]
        if a.startswith("-") and a != "-" and "." not in key:
            refuse_unknown_option(ctx, a, verb, after=after)
        i += 1 if "=" in a or not a.startswith("--") else 2  # --key VALUE: skip the value (it may start with -)


SPEC_SUFFIXES = (".toml", ".yaml", ".yml", ".json")


def overrides_first(config: str | None, args: list[str]) -> bool:
    """`tandem spec --optim.lr 0.1`: CONFIG is optional, so a first word that is an override and no spec
    file among the rest means overrides of the defaults (not a misplaced override before CONFIG)."""
    return (config is not None and config.startswith("--") and "." in config.split("=", 1)[0]
            and not any(a.endswith(SPEC_SUFFIXES) for a in args))
