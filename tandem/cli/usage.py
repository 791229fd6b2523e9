"""click's own usage errors (what typer's parsing raises: an unknown command or option, a missing or
malformed argument) in tandem's one-line form, ``error: FIELD: what. Fix: what to do``, as every error
tandem raises itself is shown. A bare group (``tandem``, ``tandem data``) still prints its help.

click is matched by class name, not imported: typer >= 0.20 carries its own copy (``typer._click``)."""

from __future__ import annotations

import re

from tandem.core.errors import ConfigError

BRACED = re.compile(r"\{([^{}]*)\}")
NO_COMMAND = re.compile(r"No such command '(?P<name>.*?)'\.(?:\s*Did you mean (?P<near>.*?)\?)?\s*$", re.S)


def usage_error(e: BaseException) -> ConfigError | None:
    """The one-line error for click's usage error ``e``; None where click's own output is the answer
    (a bare group's help) or ``e`` is not a usage error."""
    names = {c.__name__ for c in type(e).__mro__}
    if "UsageError" not in names or "NoArgsIsHelpError" in names:
        return None
    ctx = getattr(e, "ctx", None)
    cmd = ctx.command_path if ctx is not None else "tandem"
    see = f"see `{cmd} -h`"
    message = " ".join(str(getattr(e, "message", "") or "").split()).rstrip(".")
    if "NoSuchOption" in names:
        near = list(getattr(e, "possibilities", None) or [])
        return ConfigError(f"no such option of {cmd}", field=e.option_name,
                           fix=f"did you mean {near[0]}?" if near else see)
    if "MissingParameter" in names:
        param = getattr(e, "param", None)
        what = (getattr(param, "param_type_name", None) or getattr(e, "param_type", None) or "parameter")
        return ConfigError(f"missing {what}", field=_name(param) or cmd, fix=f"{_usage(ctx) or cmd}; {see}")
    if "BadParameter" in names:
        param = getattr(e, "param", None)
        hint = getattr(e, "param_hint", None)
        hint = hint if isinstance(hint, str) else "/".join(hint) if hint else None
        return ConfigError(message[:1].lower() + message[1:], field=_name(param) or hint or cmd, fix=see)
    m = NO_COMMAND.match(str(getattr(e, "message", "")))
    if m:
        near = m.group("near")
        return ConfigError(f"no such command of {cmd}", field=m.group("name"),
                           fix=f"did you mean {near}?" if near else f"{see} for its commands")
    return ConfigError(message[:1].lower() + message[1:], field=cmd, fix=f"{_usage(ctx) or cmd}; {see}")


def _name(param) -> str | None:
    """How the user writes the parameter: an option's long flag, an argument's metavar (CONFIG, SRC...)."""
    if param is None:
        return None
    if getattr(param, "param_type_name", "") == "option":
        opts = [*param.opts, *getattr(param, "secondary_opts", ())]
        return max(opts, key=len) if opts else param.name
    return getattr(param, "metavar", None) or param.name


def _usage(ctx) -> str | None:
    """``tandem train [OPTIONS] CONFIG``: the verb's usage line, without click's 'Usage:'."""
    if ctx is None:
        return None
    try:
        pieces = " ".join(ctx.command.collect_usage_pieces(ctx))
    except Exception:  # a click without the helper: the fix then names the help alone
        return None
    # typer writes a required argument {config}; the help's table and click's usage write CONFIG
    pieces = BRACED.sub(lambda m: m.group(1).upper(), pieces).replace("......", "...")  # metavar SRC... + nargs' ...
    return f"{ctx.command_path} {pieces}".strip()
