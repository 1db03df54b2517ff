"""The method registry: one record per objective, the single place that knows what each method is.

A record holds what the rest of the stack asks about a method, so no module outside this one compares
objective names:

    label             "SetDLM", "BD3LM", ... (tables, plots)
    objective         its :class:`~setdiff_mega.diffusion.objectives.Objective` and how a config builds it
    validate(o, L, E) its config checks (raising E, the ConfigError, naming the field and the fix)
    positions(L)      (T processed positions, N positions with logits) per L-token sample: FLOPs, throughput
    run_fields        the objective fields that identify a run (a resume with other values is refused)
    causal            left-to-right only: decodes one token per step, infills from the left context only
    window / block    which decoding knobs it has (SetDLM: the window W; BD3LM / MDLM: the block size)
    cached            whether it decodes with a KV cache (MDLM: no)
    default_block(o)  its default decoding block (BD3LM: the training block; MDLM: 32)
    sampler           the sampler class (import path, resolved lazily: the registry sits below inference)
    likelihood        its likelihood estimator: "exact" | "any-order bound" | "NELBO"

Adding an objective = one module with its Objective (and sampler) + one :func:`register` call; see
"How to add an objective" in ``docs/architecture.md``. The registry imports nothing heavy (config.py
uses it).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


class MethodError(ValueError):
    """An unknown objective name (config validation turns it into a ConfigError naming objective.name)."""


def _import(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def default_s_max(D: int, S_max: int | None = None) -> int:
    """SetDLM's window S_max: 2D unless set (method.md 2.2)."""
    return 2 * int(D) if S_max is None else int(S_max)


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    objective: str                                   # "module:Class"
    build_args: Callable                             # (o, mask_id, eos_id) -> kwargs of the Objective
    sampler: str                                     # "module:Class"
    likelihood: str
    streams: int = 1                                 # 2: clean + noisy stream (2L processed positions)
    causal: bool = False
    window: bool = False
    block: bool = False
    cached: bool = True                              # decodes with a KV cache (MDLM: a fixed canvas, no cache)
    default_block: Callable = lambda o: 0
    run_fields: tuple = ()
    validate: Callable = lambda o, L, error: None
    options: tuple = field(default=())               # objective fields only this method accepts

    def positions(self, L: int) -> tuple[int, int]:
        """(T positions the model processes, N positions that get logits) per L-token sample."""
        if self.causal:
            return L - 1, L - 1
        return self.streams * L, L

    def build(self, o, mask_id: int, eos_id: int | None = None):
        return _import(self.objective)(mask_id, **self.build_args(o, mask_id, eos_id))

    def sampler_class(self):
        return _import(self.sampler)


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add (or replace) a method; returns it. Config validation, the factory, the samplers, FLOPs and the
    evaluation see it at once."""
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> Method:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise MethodError(f"objective.name={name!r} is not one of {', '.join(_REGISTRY)}") from None


def names() -> tuple:
    return tuple(_REGISTRY)


def decoding_defaults(o, seq_length: int) -> dict:
    """A checkpoint's decoding defaults (GenerationConfig fields): the window W = D, the method's default
    block (else 32) and the training length L as the context budget. Read by the tools' options and
    written into every export's ``generation_config.json``."""
    return {"window": int(o.D), "block_size": get(o.name).default_block(o) or 32, "context_length": int(seq_length)}


def _validate_setdlm(o, L, error):
    s_max = default_s_max(o.D, o.S_max)
    if o.D < 1:
        raise error(f"objective.D={o.D} must be >= 1")
    if o.D > s_max:
        raise error(f"objective.D={o.D} exceeds objective.S_max={s_max}; set S_max >= D "
                    f"(the default is 2*D: remove the S_max override)")
    if s_max > L:
        raise error(f"objective.S_max={s_max} exceeds data.seq_length L={L}; set S_max <= L "
                    f"(or lower objective.D, since S_max defaults to 2*D)")
    if o.k is not None and o.b is not None:
        raise error("objective.k and objective.b are alternatives: set at most one")
    if o.k is not None and o.k <= 0:
        raise error(f"objective.k={o.k} must be > 0")


def _validate_bd3lm(o, L, error):
    if o.block_size < 1 or L % o.block_size:
        raise error(f"objective.block_size={o.block_size} must be >= 1 and divide data.seq_length={L}")


_OBJ = "setdiff_mega.diffusion.objectives:"
_INF = "setdiff_mega.standalone."
AR = register(Method(
    "ar", "AR", _OBJ + "ARObjective", lambda o, m, e: {}, _INF + "baselines:ARSampler", "exact", causal=True))
MDLM = register(Method(
    "mdlm", "MDLM", _OBJ + "MDLMObjective", lambda o, m, e: {"loss_weighting": o.loss_weighting, "t_eps": o.t_eps},
    _INF + "baselines:MDLMSampler", "NELBO", block=True, cached=False, default_block=lambda o: 32))
BD3LM = register(Method(
    "bd3lm", "BD3LM", _OBJ + "BD3LMObjective",
    lambda o, m, e: {"block_size": o.block_size, "loss_weighting": o.loss_weighting, "t_eps": o.t_eps},
    _INF + "baselines:BD3LMSampler", "NELBO", streams=2, block=True, default_block=lambda o: o.block_size,
    run_fields=("block_size",), validate=_validate_bd3lm))
SETDLM = register(Method(
    "setdlm", "SetDLM", _OBJ + "SetDLMObjective",
    lambda o, m, e: {"D": o.D, "S_max": o.S_max, "k": o.k, "b": o.b, "keep_clean_bos": o.keep_clean_bos,
                     "eos_last": o.eos_last, "eos_id": e, "fim_rate": o.fim_rate, "fim_max_middle": o.fim_max_middle,
                     "fim_max_suffix": o.fim_max_suffix},
    _INF + "setdlm:SetDLMSampler", "any-order bound", streams=2, window=True,
    run_fields=("D", "S_max"), validate=_validate_setdlm,
    options=("fim_rate",)))


__all__ = ["Method", "MethodError", "register", "unregister", "get", "names", "default_s_max", "decoding_defaults",
           "AR", "MDLM", "BD3LM", "SETDLM"]
