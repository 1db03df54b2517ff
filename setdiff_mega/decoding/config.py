"""Decoding options: :class:`GenerationConfig` and the one table of bounds every option is checked against
(:data:`BOUNDS`: the CLI, the Python API, the export and the server refuse a value outside it with one line).

Bounds: every length and count in [lo, :data:`MAX_TOKENS`] (far beyond any context, far from integer overflow,
so no window or count can wrap around and stall a decode), floats finite, probabilities in [0, 1], the seed a
non-negative 64-bit integer; ``None`` where an option is optional.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace

from .sampling import COMMIT_RULES

MAX_TOKENS = 1 << 20             # a bound on every length and count: beyond any context, far from overflow
# field: (type, lowest, highest), inclusive; None = optional (a None value is allowed). Floats must be finite.
BOUNDS = {
    "max_new_tokens": (int, 0, MAX_TOKENS), "window": (int, 1, MAX_TOKENS), "commit_k": (int, 1, MAX_TOKENS),
    "block_size": (int, 1, MAX_TOKENS), "tau": (float, 0.0, 1e308), "temperature": (float, 0.0, 1e4),
    "top_p": (float, 1e-300, 1.0), "repetition_penalty": (float, 1e-2, 1e2),
    "context_length": ((int, None), 2, MAX_TOKENS), "min_new_tokens": (int, 0, MAX_TOKENS),
    "stop_regex_count": (int, 1, MAX_TOKENS), "stop_repeat": (int, 0, MAX_TOKENS),
    "stop_confidence": ((float, None), 0.0, 1.0), "stop_patience": (int, 1, MAX_TOKENS),
    "stop_entropy": ((float, None), 0.0, 1e3), "stop_entropy_window": (int, 1, MAX_TOKENS),
    "seed": (int, 0, 2 ** 63 - 1),
}


def _bounded(name: str, value, kind, lo, hi) -> None:
    """``value`` of ``kind`` (a tuple with None: optional) within [lo, hi], else one-line ValueError."""
    if isinstance(kind, tuple):
        if value is None:
            return
        kind = kind[0]
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else \
        isinstance(value, int) and not isinstance(value, bool)
    if not ok_type:
        raise ValueError(f"{name}={value!r} must be {'a number' if kind is float else 'an integer'}"[:200])
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} must be in [{lo:g}, {hi:g}]")


@dataclass
class GenerationConfig:
    """Decoding options; the README's table maps each to the reference's name."""
    max_new_tokens: int = 64      # plain prompts: MASK positions appended after the prompt
    window: int = 4               # SetDLM: positional window W from the leftmost masked position
    tau: float = 0.9              # commit every token with confidence >= tau (> 1: one token per step)
    commit_k: int = 1             # always commit k tokens of the active set: the most confident ones, or
    commit_rule: str = "auto"     # with "leftmost" the k leftmost active positions (AR-anchored); "auto":
                                  # leftmost for a SetDLM with the AR head shift, else "confidence" (.sampling)
    block_size: int = 4           # BD3LM block size S; MDLM semi-autoregressive block size
    temperature: float = 0.0      # 0 = greedy
    top_p: float = 1.0            # nucleus filter (greedy too: the confidence is renormalised)
    repetition_penalty: float = 1.0   # > 1 penalises tokens already in the context
    length_penalty: tuple | None = None   # (start, factor): exponential-decay EOS boost after start tokens
    use_cache: bool = True        # False: recompute the whole history every step (exactness reference)
    static_shapes: bool = False   # SetDLM + cache: every decode step one shape, the cache at fixed addresses
                                  # (exported model on CUDA: steps replayed from CUDA graphs; capture.py)
    context_length: int | None = None   # cache + chunk budget = the training length L (None: the model's)
    fht_cache_order: bool = False # SetDLM: same-step commits enter the cache in first-hitting-time order
    infill_full_context: bool = True  # SetDLM infill: prefill prefix AND suffix (False: prefix only)
    stop_at_eos: bool = True      # plain prompts stop at the first EOS past min_new_tokens
    min_new_tokens: int = 0       # no EOS / confidence / entropy stop before this many generated tokens
    stop_strings: tuple = ()      # stop once the decoded generation contains one of these
    stop_regex: str | None = None # stop once the decoded prompt + generation has stop_regex_count matches
    stop_regex_count: int = 1
    stop_repeat: int = 0          # stop on a run of this many identical tokens (0: off)
    stop_confidence: float | None = None  # stop after stop_patience committed tokens below this confidence
    stop_patience: int = 1
    stop_entropy: float | None = None     # stop when the last stop_entropy_window tokens' entropy is lower
    stop_entropy_window: int = 256
    seed: int = 0                 # sampling RNG (and the first-hitting times)
    record: bool = False          # keep the canvas after every step (GenerationOutput.trace) and each
                                  # generated token's commit step and confidence (.commit_steps, .confidences)
    speculative: bool = False     # SetDLM self-speculation (method.md 16): each forward verifies the last drafts
                                  # with the AR head and drafts the next window; greedy: AR mode's exact tokens,
                                  # sampled: AR mode's distribution (the speculative-sampling rejection rule)

    def validate(self) -> "GenerationConfig":
        """Every field inside its declared bound (:data:`BOUNDS`: the one table the CLI, the API and the server
        check against), of its type, finite; the choices and the regular expression valid."""
        for name, (kind, lo, hi) in BOUNDS.items():
            _bounded(name, getattr(self, name), kind, lo, hi)
        if self.commit_rule not in ("auto", *COMMIT_RULES):
            raise ValueError(f"commit_rule={self.commit_rule!r} must be one of auto, {', '.join(COMMIT_RULES)}")
        if self.stop_repeat == 1:
            raise ValueError(f"stop_repeat={self.stop_repeat} must be 0 or >= 2")
        lp = self.length_penalty
        if lp is not None:
            if not isinstance(lp, (tuple, list)) or len(lp) != 2:
                raise ValueError(f"length_penalty={lp!r} must be (start, factor)")
            _bounded("length_penalty start", lp[0], int, 0, MAX_TOKENS)
            _bounded("length_penalty factor", lp[1], float, 1e-3, 1e3)
        if self.speculative:
            self._check_speculative()
        if self.stop_regex:
            try:
                re.compile(self.stop_regex)
            except re.error as e:
                raise ValueError(f"stop_regex={self.stop_regex!r} is not a regular expression ({e})") from None
        return self

    def _check_speculative(self) -> None:
        """The options self-speculation (method.md 16) cannot honour exactly, refused with one line each."""
        refused = [(self.repetition_penalty != 1.0, f"repetition_penalty={self.repetition_penalty} (a draft's "
                                                    f"verification would need the drafts before it in its context)"),
                   (self.length_penalty is not None, f"length_penalty={self.length_penalty}"),
                   (self.fht_cache_order, "fht_cache_order (drafts are verified and cached left to right)"),
                   (not self.infill_full_context, "infill_full_context=False (prefix-only infill)"),
                   (self.static_shapes, "static_shapes (a speculative step's chunk width varies)")]
        for bad, what in refused:
            if bad:
                raise ValueError(f"speculative=True does not combine with {what}")

    @classmethod
    def from_strings(cls, values: dict, base: "GenerationConfig | None" = None) -> "GenerationConfig":
        """Overrides given as strings (lm-eval ``model_args``, dotted CLI pairs), converted by field type."""
        known = {f.name: f for f in fields(cls)}
        out = {}
        for k, v in values.items():
            if k not in known:
                raise ValueError(f"unknown generation option {k!r}; options: {', '.join(known)}")
            out[k] = _parse(k, v, getattr(base or cls(), k))
        return replace(base or cls(), **out)


def _parse(name: str, value, default):
    if not isinstance(value, str):
        return value
    v = value.strip()
    if v.lower() in ("none", "null", ""):
        return None
    if isinstance(default, bool):
        if v.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{name}={value!r}: expected true or false")
        return v.lower() in ("true", "1", "yes")
    if name == "length_penalty":
        parts = v.replace(":", ",").split(",")
        if len(parts) != 2:
            raise ValueError(f"length_penalty={value!r}: expected START,FACTOR (e.g. 80,1.1)")
        return (int(parts[0]), float(parts[1]))
    if name == "stop_strings":
        return tuple(s for s in v.split("|") if s)
    if isinstance(default, int):
        return int(v)
    if isinstance(default, float) or name in ("stop_confidence", "stop_entropy"):
        return float(v)
    return v


__all__ = ["GenerationConfig", "BOUNDS", "MAX_TOKENS"]
