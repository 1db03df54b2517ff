"""The ``objective`` section: the method's name and its own options.

Each method owns its config fields (its registry record's :class:`~setdiff_mega.methods.Options`
dataclass: SetDLM's ``D``, ``S_max``, ...; BD3LM's ``block_size``; ...). The section keeps the flat layout
of configs and checkpoints (``objective.name=setdlm objective.D=8``, ``objective: {name: setdlm, D: 8}``):
:meth:`ObjectiveConfig.from_mapping` gives the chosen method the fields it has (typed by its dataclass),
ignores fields that only other methods have (a preset's ``D`` when ``objective.name=ar`` is overridden;
a method's ``EXCLUSIVE`` fields set to another value are refused), and refuses a field no method has. The
options' fields read as the section's attributes (``cfg.objective.D``); a field only other methods have
reads as its default (it does not apply to this objective).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Callable

from setdiff_mega import (
    diffusion,  # noqa: F401  (imports the built-in methods: their records register)
    methods,
)

from .errors import ConfigError

DEFAULT = "setdlm"


class ObjectiveConfig:
    """``objective.name`` and the method's options (``.options``); option fields read as attributes."""

    def __init__(self, name: str = DEFAULT, **options):
        self.name = name
        try:
            method = methods.get(name)
        except methods.MethodError as e:
            raise ConfigError(str(e)) from None
        try:
            self.options = method.make_options(options)
        except TypeError:
            known = ", ".join(f.name for f in dataclasses.fields(method.options)) or "none"
            raise ConfigError(f"objective {name!r} has no option among {sorted(options)}; its options: {known}") \
                from None

    @property
    def method(self) -> methods.Method:
        return methods.get(self.name)

    def __getattr__(self, key: str):
        if key.startswith("__") or key in ("options", "name"):
            raise AttributeError(key)
        try:
            return getattr(self.options, key)
        except AttributeError:
            pass
        owners = methods.option_owners(key)          # another method's field: it does not apply (its default)
        if owners:
            return owners[0].options.__dataclass_fields__[key].default
        raise AttributeError(f"objective {self.name!r} has no option {key!r}")

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectiveConfig) and (self.name, self.options) == (other.name, other.options)

    def __repr__(self) -> str:
        return f"ObjectiveConfig(name={self.name!r}, {self.options!r})"

    def check(self, L: int) -> None:
        """The method's own checks (its Options)."""
        self.options.check(L, ConfigError)

    def to_mapping(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self.options)}

    @classmethod
    def from_mapping(cls, data: dict, prefix: str, coerce: Callable[[Any, Any, str], Any]) -> "ObjectiveConfig":
        """``{name, field: value, ...}`` (YAML / overrides / a checkpoint's config) -> the section; ``coerce``
        types each value like every other config field."""
        name = coerce(data.get("name", DEFAULT), str, f"{prefix}.name")
        try:
            method = methods.get(name)
        except methods.MethodError as e:
            raise ConfigError(str(e)) from None
        types = _resolved_types(method.options)
        own = {}
        for key, value in data.items():
            if key == "name":
                continue
            full = f"{prefix}.{key}"
            if key in types:
                own[key] = coerce(value, types[key], full)
                continue
            owners = methods.option_owners(key)
            if not owners:
                known = sorted({f.name for m in map(methods.get, methods.names())
                                for f in dataclasses.fields(m.options)} | {"name"})
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean '{prefix}.{close[0]}'?" if close else f"; known fields: {', '.join(known)}"
                raise ConfigError(f"unknown config field '{full}'{hint}")
            _refuse_exclusive(owners, key, coerce(value, _resolved_types(owners[0].options)[key], full), name)
        return cls(name, **own)


def _resolved_types(options_cls) -> dict:
    """field -> type of an Options dataclass (its ClassVars left out)."""
    names = {f.name for f in dataclasses.fields(options_cls)}
    return {k: v for k, v in typing.get_type_hints(options_cls).items() if k in names}


def _refuse_exclusive(owners: list, key: str, value, name: str) -> None:
    """A field only other methods have is ignored, unless its owner marks it exclusive and it is set."""
    for m in owners:
        default = m.options.__dataclass_fields__[key].default
        if key in m.options.EXCLUSIVE and value != default:
            raise ConfigError(f"objective.{key} is a {m.label} option (objective.name={name}); set it to {default} "
                              f"or use objective.name={m.name}")


__all__ = ["ObjectiveConfig", "DEFAULT"]
