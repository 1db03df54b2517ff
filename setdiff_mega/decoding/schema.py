"""The generation options' one schema: each field of :class:`~.config.GenerationConfig` carries an
:class:`Option` in its ``dataclasses`` metadata, and every surface that takes the options is generated from it:

    type        kind: "int" | "float" | "bool" | "str" | "pair" ((start, factor): an int and a float) |
                "strings" (a tuple of strings)
    bounds      lo <= value <= hi, inclusive (a pair: per element); floats finite
    nullable    None is a value (the option is off / the model's)
    choices     the values a "str" option takes
    help        one line (the CLI's ``--help``, the options table in docs/guide/decoding.md)
    reference   the reference implementation's (setdlms) name; None: this stack's own
    cli         the flag ("--tau"; None: not on the command line); a "bool" option's flag is a switch that
                sets ``flag_value`` (``--no-cache`` sets ``use_cache`` False); a "strings" option's flag repeats
    server      a request field of the OpenAI-compatible server (serving/protocol.py)
    export      an option of the exported model's ``generate`` (hfmodel/generation_setdlm.py)

Values arrive in three shapes, each converted here by the option's kind: strings (CLI flags, lm-eval
``model_args``: :func:`from_string`), JSON values (a server request: :func:`from_json`) and Python values
(``model.generate(**options)``: :func:`from_python`); :func:`check` is the one bound check, with one line
naming the field. :func:`options_table` writes the Markdown table of docs/guide/decoding.md (``config.write_guide``
regenerates it; a unit test fails when it is stale).

Only the standard library: this module is copied into every export with the rest of ``decoding/``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

KINDS = ("int", "float", "bool", "str", "pair", "strings")
_NUMBER = {"int": "an integer", "float": "a number"}
PAIR_PARTS = ("start", "factor")


@dataclass(frozen=True)
class Option:
    """One generation option's schema (module docstring)."""
    kind: str
    help: str
    lo: object = None
    hi: object = None
    nullable: bool = False
    choices: tuple = ()
    reference: str | None = None
    cli: str | None = None
    flag_value: object = None
    server: bool = False
    export: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Option kind={self.kind!r} must be one of {', '.join(KINDS)}")

    @property
    def dest(self) -> str | None:
        """The argparse attribute of the CLI flag."""
        return None if self.cli is None else self.cli.lstrip("-").replace("-", "_")


def option(default, **spec) -> dataclasses.Field:
    """A GenerationConfig field with its :class:`Option` (``spec``: Option's fields) as metadata."""
    return dataclasses.field(default=default, metadata={"option": Option(**spec)})


def options(cls) -> dict[str, Option]:
    """name -> Option of every field of the dataclass ``cls``, in declaration order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(cls)}


def _number(name: str, value, kind: str, lo, hi) -> None:
    ok = isinstance(value, (int, float)) if kind == "float" else isinstance(value, int)
    if not ok or isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be {_NUMBER[kind]}"[:200])
    if kind == "float" and not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} must be in [{lo:g}, {hi:g}]")


def check(name: str, opt: Option, value) -> None:
    """``value`` of the option's kind, inside its bounds and choices; else a one-line ValueError naming it."""
    if value is None and opt.nullable:
        return
    if opt.kind in _NUMBER:
        _number(name, value, opt.kind, opt.lo, opt.hi)
    elif opt.kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be true or false"[:200])
    elif opt.kind == "str":
        if not isinstance(value, str) or (opt.choices and value not in opt.choices):
            what = f"one of {', '.join(opt.choices)}" if opt.choices else "a string"
            raise ValueError(f"{name}={value!r} must be {what}"[:200])
    elif opt.kind == "pair":
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"{name}={value!r} must be ({', '.join(PAIR_PARTS)})"[:200])
        for part, kind, v, lo, hi in zip(PAIR_PARTS, ("int", "float"), value, opt.lo, opt.hi):
            _number(f"{name} {part}", v, kind, lo, hi)
    elif not isinstance(value, (tuple, list)) or not all(isinstance(s, str) for s in value):
        raise ValueError(f"{name}={value!r} must be a list of strings"[:200])


def from_string(name: str, opt: Option, text):
    """A value given as a string (a CLI flag, lm-eval ``model_args``); "none" / "null" / "" is None."""
    if not isinstance(text, str):
        return text
    v = text.strip()
    if v.lower() in ("none", "null", ""):
        return None
    if opt.kind == "bool":
        if v.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{name}={text!r}: expected true or false")
        return v.lower() in ("true", "1", "yes")
    if opt.kind == "pair":
        parts = v.replace(":", ",").split(",")
        if len(parts) != 2:
            raise ValueError(f"{name}={text!r}: expected START,FACTOR (e.g. 80,1.1)")
        return (_scalar(name, "int", parts[0], text), _scalar(name, "float", parts[1], text))
    if opt.kind == "strings":
        return tuple(s for s in v.split("|") if s)
    return _scalar(name, opt.kind, v, text) if opt.kind in _NUMBER else v


def _scalar(name: str, kind: str, v: str, text: str):
    try:
        return int(v) if kind == "int" else float(v)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected {_NUMBER[kind]}"[:200]) from None


def from_json(name: str, opt: Option, value):
    """A JSON value (a server request's field) converted to the option's Python type (an int where a float is
    asked becomes a float; a pair arrives as a list); type errors as one line. Bounds: :func:`check`."""
    if value is None and opt.nullable:
        return None
    if opt.kind == "pair":
        if not (isinstance(value, list) and len(value) == 2 and
                all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise ValueError(f"'{name}' must be [{', '.join(PAIR_PARTS)}] or null")
        return _json_pair(name, opt, value)
    want = {"int": int, "float": (int, float), "bool": bool, "str": str, "strings": list}[opt.kind]
    if not isinstance(value, want) or (opt.kind in _NUMBER and isinstance(value, bool)):
        what = _NUMBER.get(opt.kind) or {"bool": "a bool", "str": "a str", "strings": "a list"}[opt.kind]
        raise ValueError(f"'{name}' must be {what}, got {value!r}"[:200])
    if opt.kind == "float":
        return float(value)
    return tuple(value) if opt.kind == "strings" else value


def _json_pair(name: str, opt: Option, value: list) -> tuple:
    if not all(math.isfinite(v) for v in value):
        raise ValueError(f"'{name}' must be finite numbers, got {value!r}"[:200])
    return (int(value[0]), float(value[1]))


def from_python(name: str, opt: Option, value):
    """A Python value (``model.generate(**options)``): lists become tuples, a single stop string a tuple."""
    if opt.kind == "strings" and isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def _num(v) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def _bounds(opt: Option) -> str:
    if opt.kind in _NUMBER:
        text = f"{opt.kind} in [{_num(opt.lo)}, {_num(opt.hi)}]"
    elif opt.kind == "pair":
        text = (f"(start in [{_num(opt.lo[0])}, {_num(opt.hi[0])}], "
                f"factor in [{_num(opt.lo[1])}, {_num(opt.hi[1])}])")
    elif opt.choices:
        text = " / ".join(opt.choices)
    else:
        text = {"bool": "bool", "str": "string", "strings": "strings"}[opt.kind]
    return text + (" or None" if opt.nullable else "")


def _cli(opt: Option) -> str:
    if opt.cli is None:
        return ""
    if opt.kind == "bool":
        return f"`{opt.cli}` (sets {opt.flag_value})"
    return f"`{opt.cli}`" + (" (repeatable)" if opt.kind == "strings" else "")


def options_table(cls) -> str:
    """The Markdown table of every option of ``cls`` (docs/guide/decoding.md, between its markers)."""
    rows = ["| option (default) | type and bounds | CLI flag | server field | reference (setdlms) | what it does |",
            "|---|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        opt = f.metadata["option"]
        cells = [f"`{f.name}` ({f.default!r})", _bounds(opt), _cli(opt), f"`{f.name}`" if opt.server else "",
                 f"`{opt.reference}`" if opt.reference else "(this stack's)", opt.help]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- options:begin -->", "<!-- options:end -->"
GUIDE = "docs/guide/decoding.md"


def with_table(text: str, cls) -> str:
    """``text`` (a Markdown page) with :func:`options_table` of ``cls`` between the markers BEGIN and END."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"the page has no {BEGIN} ... {END} markers around the options table; add them")
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{options_table(cls)}{END}{rest.split(END, 1)[1]}"


__all__ = ["Option", "option", "options", "check", "from_string", "from_json", "from_python", "options_table",
           "with_table", "KINDS", "BEGIN", "END", "GUIDE"]
