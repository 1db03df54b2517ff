"""Loading configs: YAML presets + dotted overrides -> a validated RunConfig, and back to dicts / YAML.

Every field has a type; YAML values and overrides are coerced to it (``"3e-4"`` -> float, ``"null"`` ->
None) and an unknown or mistyped field stops with a ConfigError that names the field and suggests the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from .sections import ConfigError, RunConfig, validate
from .yamlfile import read_yaml


def _coerce(value: Any, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            return None
        return _coerce(value, args[0], name)
    if dataclasses.is_dataclass(tp) or hasattr(tp, "from_mapping"):
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping of fields, got {value!r}")
        if hasattr(tp, "from_mapping"):              # a section that resolves its own fields (objective)
            return tp.from_mapping(value, name, _coerce)
        return _from_dict(tp, value, name)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) else int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {getattr(tp, '__name__', tp)}, got {value!r}") from None
    return value


def _from_dict(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else \
                f"; known fields: {', '.join(names)}"
            raise ConfigError(f"unknown config field '{full}'{hint}")
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> dict:
    """['a.b=1', 'c.d=x'] -> nested dict with YAML-typed values."""
    tree: dict = {}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.field=value (e.g. train.lr=3e-4)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                check: bool = True) -> RunConfig:
    """YAML file (optional) + dotted overrides -> validated :class:`RunConfig`."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist; presets live in configs/ (e.g. "
                              f"configs/tiny_cpu.yaml)")
        tree = read_yaml(p, "config file", ConfigError) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections")
    tree = _merge(tree, parse_overrides(overrides))
    cfg = _from_dict(RunConfig, tree)
    if check:
        validate(cfg)
    return cfg


def to_dict(cfg) -> dict:
    """The config as plain nested dicts (a section with ``to_mapping`` gives its own)."""
    if hasattr(cfg, "to_mapping"):
        return cfg.to_mapping()
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return cfg


def from_dict(data: dict) -> RunConfig:
    return _from_dict(RunConfig, data)


def dump_yaml(cfg, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))



__all__ = ["load_config", "parse_overrides", "to_dict", "from_dict", "dump_yaml"]
