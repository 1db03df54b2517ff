"""The method registry: one record per objective, the single place that knows what each method is.

A record holds what the rest of the stack asks about a method, so no module outside the objective's own
compares objective names:

    label             "SetDLM", "BD3LM", ... (tables, plots)
    objective         its :class:`~setdiff_mega.diffusion.objectives.Objective` class
    options           its config section: an :class:`Options` dataclass of its ``objective.*`` fields, with
                      their checks, derived values (SetDLM's S_max), the fields that identify a run
                      (``RUN_FIELDS``: a resume with other values is refused), its decoding defaults, what
                      an export records, and the shape of its attention pattern
    positions(L)      (T processed positions, N positions with logits) per L-token sample: FLOPs, throughput
    streams           1, or 2 for a clean + noisy stream (2L processed positions; context parallelism
                      splits every stream)
    causal            left-to-right only: decodes one token per step, infills from the left context only
    window / block    which decoding knobs it has (SetDLM: the window W; BD3LM / MDLM: the block size)
    cached            whether it decodes with a KV cache (MDLM: no)
    pattern           the :class:`~setdiff_mega.diffusion.masks.MaskPattern` kind of its training inputs
    sampler           the sampler class (import path, resolved lazily)
    likelihood        its likelihood estimator: "exact" | "any-order bound" | "NELBO"

The built-in methods register themselves in their own modules (``setdiff_mega/diffusion/{ar,mdlm,bd3lm,
setdlm}.py``, imported by the ``setdiff_mega.diffusion`` package). Adding an objective = one module with
its Objective, its Options (and its sampler) + one :func:`register` call; see "How to add an objective" in
``docs/architecture.md``. This module imports nothing of the project but ``decoding/trace.py`` (standard library
only), which :func:`register` tells about each record.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import ClassVar

from setdiff_mega.decoding import trace


class MethodError(ValueError):
    """An unknown objective name (config validation turns it into a ConfigError naming objective.name)."""


def _import(path):
    if not isinstance(path, str):
        return path
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass
class Options:
    """An objective's own config fields (``objective.<field>``); subclasses add fields with defaults."""

    RUN_FIELDS: ClassVar[tuple] = ()     # fields that identify a run: a resume with other values is refused
    EXCLUSIVE: ClassVar[tuple] = ()      # fields refused (set to a non-default value) under another objective
    DEFAULT_BLOCK: ClassVar[int] = 32    # decoding block size when the method has none of its own

    def check(self, L: int, error) -> None:
        """Raise ``error`` (the ConfigError) naming the field and the fix."""

    def objective_kwargs(self) -> dict:
        """Keyword arguments of the Objective's constructor (after the MASK id)."""
        return dataclasses.asdict(self)

    def decoding_defaults(self, L: int) -> dict:
        """The checkpoint's decoding defaults (GenerationConfig fields): the tools' options and every
        export's ``generation_config.json`` read them."""
        return {"block_size": self.DEFAULT_BLOCK, "context_length": int(L)}

    def preset_window(self, per_unit: float) -> int | None:
        """The window of a paper preset given in units of the method's set size (None: no window)."""
        return None

    def export_record(self) -> dict:
        """What an export's ``config.json`` ``method`` records of these options."""
        return dataclasses.asdict(self)

    def describe(self) -> list[str]:
        """Phrases for the model card ("D = 4, S_max = 8")."""
        return []

    @property
    def every_row_logits(self) -> bool:
        """The loss reads logits on every processed position (as with ``model.shift_logits``), e.g. for a
        next-token loss on a clean stream: FLOPs and memory count them; context parallelism cannot gather them."""
        return False

    @property
    def self_speculative(self) -> bool:
        """A checkpoint trained with these options (and ``model.shift_logits``) can verify its own drafts: the
        speculative decoding mode (method.md 16) accepts it."""
        return False

    @property
    def pattern_block(self) -> int:
        """The block size of the training inputs' mask pattern."""
        return 1


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    objective: object                                 # its Objective class (or "module:Class")
    sampler: str                                      # "module:Class"
    likelihood: str
    options: type = Options
    streams: int = 1                                  # 2: clean + noisy stream (2L processed positions)
    causal: bool = False
    window: bool = False
    block: bool = False
    cached: bool = True                               # decodes with a KV cache (MDLM: a fixed canvas, no cache)
    pattern: str = "full"                             # MaskPattern kind of the training inputs

    @property
    def run_fields(self) -> tuple:
        return self.options.RUN_FIELDS

    def positions(self, L: int, shift_logits: bool = False) -> tuple[int, int]:
        """(T positions the model processes, N positions that get logits) per L-token sample; with the AR
        shift (``model.shift_logits``) or options whose loss reads every row (``every_row_logits``) every
        processed position gets logits."""
        if self.causal:
            return L - 1, L - 1
        return self.streams * L, self.streams * L if shift_logits else L

    def make_options(self, values: dict | None = None) -> Options:
        """Its options from ``values`` (field -> already typed value); TypeError for an unknown field."""
        return self.options(**(values or {}))

    def build(self, options: Options, mask_id: int, eos_id: int | None = None):
        return _import(self.objective)(mask_id, eos_id=eos_id, **options.objective_kwargs())

    def sampler_class(self):
        return _import(self.sampler)


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add (or replace) a method; returns it. Config validation, the factory, the samplers, FLOPs and the
    evaluation see it at once."""
    _REGISTRY[method.name] = method
    trace.describe(method)                  # the decoding trace knows the record by its name (block or window)
    return method


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    trace.forget(name)


def get(name: str) -> Method:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise MethodError(f"objective.name={name!r} is not one of {', '.join(_REGISTRY)}") from None


def names() -> tuple:
    return tuple(_REGISTRY)


def option_owners(field: str) -> list[Method]:
    """The registered methods whose options have ``field``."""
    return [m for m in _REGISTRY.values() if field in {f.name for f in dataclasses.fields(m.options)}]


def decoding_defaults(objective_config, seq_length: int) -> dict:
    """A checkpoint's decoding defaults (its method's options, :meth:`Options.decoding_defaults`)."""
    return objective_config.options.decoding_defaults(seq_length)


__all__ = ["Method", "MethodError", "Options", "register", "unregister", "get", "names", "option_owners",
           "decoding_defaults"]
