"""Load a job spec from TOML/YAML, apply dotted overrides, and turn it back into a dict.

Every key is checked against the dataclasses in ``tandem.core.spec``: an unknown
key is an error that names the key and the nearest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from tandem.core import hf
from tandem.core.errors import ConfigError
from tandem.core.spec import JobSpec, ModelSpec


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def did_you_mean(key: str, valid: list[str]) -> str:
    """The fix for an unknown dotted key: the nearest valid one, else the list of them."""
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], [v.rsplit(".", 1)[-1] for v in valid], n=1)
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    return f"did you mean '{prefix}{near[0]}'?" if near else f"valid keys: {', '.join(sorted(valid))}"


def _unknown(key: str, valid: list[str]) -> ConfigError:
    return ConfigError("unknown key", field=key, fix=did_you_mean(key, valid))


def _keeps_extra(cls: type, name: object) -> bool:
    """A [model] section naming a factory keeps the keys tandem does not know: the factory's own
    keywords (model.extra), checked against its signature by tandem.models.build_model."""
    return cls is ModelSpec and ":" in str(name or "") and not hf.is_hf(name)


def _literal(raw: str) -> Any:
    """A command-line value for a factory's own keyword: a TOML value (3, 0.1, true, [1, 2]) or the text."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def coerce(key: str, raw: Any, tp: Any) -> Any:
    """Turn ``raw`` (from a file or a command line string) into ``tp``; name the key on failure."""
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if tp is float:
            return float(raw)
        if tp is str:
            if isinstance(raw, (dict, list)):
                raise ValueError
            return str(raw)
        if tp is dict or typing.get_origin(tp) is dict:  # a TOML inline table, or JSON on the command line
            if isinstance(raw, str):
                raw = json.loads(raw)
            if not isinstance(raw, dict):
                raise ValueError
            return dict(raw)
        if tp is list or typing.get_origin(tp) is list:
            if isinstance(raw, str):
                raw = json.loads(raw)
            if not isinstance(raw, list):
                raise ValueError
            return list(raw)
        if tp is dict:
            if not isinstance(raw, dict):
                raise ValueError
            return dict(raw)
    except (ValueError, TypeError, json.JSONDecodeError):
        name = getattr(tp, "__name__", str(tp))
        raise ConfigError(f"expected {name}, got {raw!r}", field=key,
                          fix=f"give a {name} value") from None
    return raw


def from_dict(data: dict[str, Any], cls: type = JobSpec, prefix: str = "") -> Any:
    """Build ``cls`` from nested dicts; unknown keys and wrong types raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a table, got {data!r}", field=prefix.rstrip(".") or "spec")
    if cls is ModelSpec and hf.is_hf(data.get("name")):  # a Hugging Face folder: tandem's own model, its shape
        data = hf.resolve(data)                          # from config.json (tandem/core/hf.py)
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in hints:
            if _keeps_extra(cls, data.get("name")):
                extra[key] = value
                continue
            raise _unknown(full, [f"{prefix}{k}" for k in hints])
        tp = hints[key]
        kwargs[key] = from_dict(value, tp, full + ".") if _is_section(tp) else coerce(full, value, tp)
    if extra:
        kwargs["extra"] = {**kwargs.get("extra", {}), **extra}
    return cls(**kwargs)


def to_dict(spec: Any) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def read_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("no such file", field="config", value=str(p),
                          fix="give the path of a .toml or .yaml job spec (see examples/)")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            return tomllib.loads(text)
        if p.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text) or {}
        if p.suffix == ".json":
            return json.loads(text)
    except Exception as e:  # the parser's own message says where
        raise ConfigError(f"cannot parse: {e}", field="config", value=str(p),
                          fix="correct the syntax at the place the parser names") from None
    raise ConfigError(f"unknown file type '{p.suffix}'", field="config", value=str(p),
                      fix="use .toml, .yaml/.yml or .json")


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``['--optim.lr', '0.2', '--launch.nnodes=2']`` -> ``{'optim.lr': '0.2', 'launch.nnodes': '2'}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or len(a) == 2:
            raise ConfigError("expected --section.key VALUE", field="override", value=a,
                              fix="write overrides as --optim.lr 0.2 or --optim.lr=0.2")
        key = a[2:]
        if "=" in key:
            key, val = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError("missing value", field=key, fix=f"write --{key} VALUE")
            i += 1
            val = args[i]
        out[key.replace("-", "_")] = val
        i += 1
    return out


def apply_overrides(data: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (types are checked later by ``from_dict``)."""
    hints_root = _hints(JobSpec)
    for key, val in overrides.items():
        parts = key.split(".")
        cls: Any = JobSpec
        node = data
        for depth, part in enumerate(parts):
            hints = _hints(cls)
            last = depth == len(parts) - 1
            if part not in hints and last and _keeps_extra(cls, overrides.get("model.name", node.get("name"))):
                node[part] = _literal(val)  # a factory's own keyword: from_dict files it under model.extra
                break
            if part not in hints:
                prefix = ".".join(parts[:depth])
                raise _unknown(key, [f"{prefix}.{k}" if prefix else k for k in hints])
            tp = hints[part]
            if last:
                if _is_section(tp):
                    raise ConfigError("is a section, not a value", field=key,
                                      fix=f"set one of its keys, e.g. --{key}.{next(iter(_hints(tp)))}")
                node[part] = val
            else:
                if not _is_section(tp):
                    raise _unknown(key, list(hints_root))
                node = node.setdefault(part, {})
                cls = tp
    return data


def load_spec(path: str | Path | None, overrides: list[str] | dict[str, str] | None = None,
              *, check: bool = True) -> JobSpec:
    """Read, override and (by default) validate a job spec."""
    data = read_file(path) if path else {}
    if overrides:
        ov = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = apply_overrides(data, ov)
    spec = from_dict(data)
    if check:
        from tandem.core.validate import validate

        validate(spec)
    return spec


def field_docs(cls: type = JobSpec, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every leaf field, for help screens and docs."""
    rows = []
    hints = _hints(cls)
    defaults = cls()
    for fl in dataclasses.fields(cls):
        tp = hints[fl.name]
        if _is_section(tp):
            rows += field_docs(tp, f"{prefix}{fl.name}.")
        else:
            rows.append((f"{prefix}{fl.name}", getattr(tp, "__name__", str(tp)),
                         getattr(defaults, fl.name), fl.metadata.get("help", "")))
    return rows
