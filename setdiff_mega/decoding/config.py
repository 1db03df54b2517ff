"""Decoding options: :class:`GenerationConfig`, whose fields' metadata (:mod:`.schema`) is the one schema of every
generation option: its type, bounds, nullability, help, the reference's name and where it is exposed (CLI flag,
server field, export option). The CLI flags (inference/options.py), the server's request fields
(serving/protocol.py), the export's ``generate`` options (hfmodel/generation_setdlm.py), :data:`BOUNDS` and the
options table of docs/guide/decoding.md are generated from it: adding an option is one field here (and its
effect where the logits are processed).

Bounds: every length and count in [lo, :data:`MAX_TOKENS`] (far beyond any context, far from integer overflow,
so no window or count can wrap around and stall a decode), floats finite, probabilities in [0, 1], the seed a
non-negative 64-bit integer; ``None`` where an option is nullable. :meth:`GenerationConfig.validate` checks a
config once: it remembers the values it passed, so the samplers' own call on an already validated request is free
(and an unvalidated config is checked there: none decodes unchecked); :meth:`GenerationConfig.derive` makes a
validated request's derived config (changed fields checked alone), so a request is validated once in all.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

from .sampling import COMMIT_RULES
from .schema import GUIDE, check, from_string, option, options, with_table

MAX_TOKENS = 1 << 20             # a bound on every length and count: beyond any context, far from overflow
_M = MAX_TOKENS


@dataclass
class GenerationConfig:
    """Decoding options (each field's :class:`~.schema.Option`: its bounds, help, reference name and exposure)."""
    max_new_tokens: int = option(
        64, kind="int", lo=0, hi=_M, reference="max_new_tokens", cli="--max-new-tokens",
        help="MASK positions generated after a plain prompt (may run past L)")
    window: int = option(
        4, kind="int", lo=1, hi=_M, reference="max_window_size", cli="--window", server=True,
        help="SetDLM positional window W from the leftmost masked position (default: the checkpoint's D)")
    tau: float = option(
        0.9, kind="float", lo=0.0, hi=1e308, reference="confidence_threshold", cli="--tau", server=True,
        help="commit every token with confidence >= tau; > 1 commits one token per step")
    commit_k: int = option(
        1, kind="int", lo=1, hi=_M, reference="k = round(tN) - round(t'N) of predict_and_noise", cli="--commit-k",
        server=True, help="tokens always committed per step (the most confident ones, or see --commit-rule)")
    commit_rule: str = option(
        "auto", kind="str", choices=("auto", *COMMIT_RULES), cli="--commit-rule", server=True,
        help="which k tokens are always committed: confidence (the paper), leftmost (AR-anchored, method.md 15) "
             "or auto (leftmost for a SetDLM with the AR head shift, else confidence)")
    block_size: int = option(
        4, kind="int", lo=1, hi=_M, reference="block_size", cli="--block-size", server=True,
        help="BD3LM block S (default: the training block) / MDLM semi-autoregressive block (32)")
    temperature: float = option(
        0.0, kind="float", lo=0.0, hi=1e4, reference="do_sample", cli="--temperature", server=True,
        help="0 = greedy")
    top_p: float = option(
        1.0, kind="float", lo=1e-300, hi=1.0, reference="nucleus_p", cli="--top-p", server=True,
        help="nucleus filter after the softmax, the crossing token kept (greedy confidences are renormalised)")
    min_p: float = option(
        0.0, kind="float", lo=0.0, hi=1.0, cli="--min-p", server=True,
        help="keep the tokens whose probability is >= min_p x the top token's (0: off; transformers' "
             "MinPLogitsWarper, after top_p)")
    repetition_penalty: float = option(
        1.0, kind="float", lo=1e-2, hi=1e2, reference="RepetitionPenaltyLogitsProcessor(penalty)",
        cli="--repetition-penalty", server=True,
        help="> 1 penalises tokens already in the context (infill: every visible token)")
    length_penalty: tuple | None = option(
        None, kind="pair", lo=(0, 1e-3), hi=(_M, 1e3), nullable=True, cli="--length-penalty", server=True,
        reference="ExponentialDecayLengthPenalty((start, factor), eos, 0)",
        help="START,FACTOR: exponential-decay EOS boost after START generated tokens")
    use_cache: bool = option(
        True, kind="bool", reference="use_cache", cli="--no-cache", flag_value=False,
        help="off: recompute the whole history every step (exactness reference)")
    static_shapes: bool = option(
        False, kind="bool", cli="--static-shapes", flag_value=True,
        help="SetDLM + cache: one shape for every decode step, the cache at fixed addresses (exported model on "
             "CUDA: CUDA-graph replay, hfmodel/capture.py)")
    context_length: int | None = option(
        None, kind="int", lo=2, hi=_M, nullable=True, reference="config.length", cli="--context-length",
        help="cache + chunk budget (default: the training length L)")
    fht_cache_order: bool = option(
        False, kind="bool", reference="setdlm_fht_cache_order", cli="--fht-cache-order", flag_value=True,
        server=True, help="SetDLM: same-step commits enter the cache in first-hitting-time order")
    infill_full_context: bool = option(
        True, kind="bool", reference="cache_full_infill_context", cli="--prefix-only-infill", flag_value=False,
        server=True, help="SetDLM infill: prefill prefix and suffix (off: the prefix only)")
    stop_at_eos: bool = option(
        True, kind="bool", reference="EntropyEosStoppingCriteria(var_length=true)", cli="--no-eos-stop",
        flag_value=False, server=True, help="plain prompts stop at the first EOS past min_new_tokens")
    min_new_tokens: int = option(
        0, kind="int", lo=0, hi=_M, reference="confidence_min_tokens", cli="--min-new-tokens", server=True,
        help="no EOS / confidence / entropy stop before this many generated tokens")
    stop_strings: tuple = option(
        (), kind="strings", reference="lm-eval until", cli="--stop",
        help="stop once the decoded generation contains one of these (the server's 'stop')")
    stop_regex: str | None = option(
        None, kind="str", nullable=True, reference="RegexStoppingCriteria(pattern)", cli="--stop-regex",
        server=True, help="stop once the prompt + generation has --stop-regex-count matches")
    stop_regex_count: int = option(
        1, kind="int", lo=1, hi=_M, reference="RegexStoppingCriteria(num_matches)", cli="--stop-regex-count",
        server=True, help="matches needed by --stop-regex")
    stop_repeat: int = option(
        0, kind="int", lo=0, hi=_M, reference="RepeatingTokenStoppingCriteria(min_run_length)",
        cli="--stop-repeat", server=True, help="stop on a run of this many identical tokens (0: off, else >= 2)")
    stop_confidence: float | None = option(
        None, kind="float", lo=0.0, hi=1.0, nullable=True, cli="--stop-confidence", server=True,
        reference="EntropyEosStoppingCriteria(confidence_threshold)",
        help="stop after --stop-patience committed tokens below this confidence")
    stop_patience: int = option(
        1, kind="int", lo=1, hi=_M, reference="EntropyEosStoppingCriteria(confidence_patience)",
        cli="--stop-patience", server=True, help="consecutive low-confidence tokens that stop")
    stop_entropy: float | None = option(
        None, kind="float", lo=0.0, hi=1e3, nullable=True, reference="EntropyEosStoppingCriteria(entropy_threshold)",
        cli="--stop-entropy", server=True,
        help="stop when the token entropy of the last --stop-entropy-window tokens is lower")
    stop_entropy_window: int = option(
        256, kind="int", lo=1, hi=_M, reference="EntropyEosStoppingCriteria(block_size)",
        cli="--stop-entropy-window", server=True, help="window of --stop-entropy")
    seed: int = option(
        0, kind="int", lo=0, hi=2 ** 63 - 1, reference="seed", cli="--seed", server=True,
        help="sampling seed (and the first-hitting times); a row decodes the same in any batch")
    record: bool = option(
        False, kind="bool",
        help="keep the canvas after every step (GenerationOutput.trace) and each generated token's commit step and "
             "confidence (the server's 'trace')")
    speculative: bool = option(
        False, kind="bool", cli="--speculative", flag_value=True, server=True,
        help="SetDLM self-speculation (method.md 16): the model's own greedy left-to-right (AR mode) tokens, drafted "
             "by the window and verified by the AR head, several per forward (sampled: AR mode's distribution); "
             "needs a checkpoint trained with model.shift_logits and objective.ar_weight > 0")

    def validate(self) -> "GenerationConfig":
        """Every field of its kind, inside its bounds and choices (:mod:`.schema`), finite; the cross-field rules;
        the regular expression valid. Checks once: the values that passed are remembered (they travel with the
        config, also pickled to the server's engine), and a later call on the same, unchanged config returns at
        once; a config changed since is checked again, and a ``replace`` makes a new, unchecked config (derive one
        from a validated config with :meth:`derive`)."""
        if self.__dict__.get("_validated") != self._values():
            self._check()
            self._passed()
        return self

    def derive(self, **changes) -> "GenerationConfig":
        """``replace(self, **changes)``, validated without checking the whole request again: this config
        validated (once: free when it was), the changed fields checked (kind, bounds) with the cross-field rules,
        the result remembered as validated (a request's derived configs: the server's per-sample seeds, a shared
        decode's ``max_new_tokens``, the model's context length). One-line ValueError for a changed field out of
        bounds."""
        self.validate()
        unknown = [k for k in changes if k not in OPTIONS]
        if unknown:
            raise ValueError(f"unknown generation option {unknown[0]!r}; options: {', '.join(OPTIONS)}")
        out = replace(self, **changes)
        for name in changes:
            check(name, OPTIONS[name], changes[name])
        out._rules()
        out._passed()
        return out

    def _values(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    def _passed(self) -> None:
        self.__dict__["_validated"] = self._values()

    def _check(self) -> None:
        """The whole check (:meth:`validate`): every field, then the cross-field rules."""
        for name, opt in OPTIONS.items():
            check(name, opt, getattr(self, name))
        self._rules()

    def _rules(self) -> None:
        """The cross-field rules and the regular expression (each field already of its kind)."""
        if self.stop_repeat == 1:
            raise ValueError(f"stop_repeat={self.stop_repeat} must be 0 or >= 2")
        if self.speculative:
            self._check_speculative()
        if self.stop_regex:
            try:
                re.compile(self.stop_regex)
            except re.error as e:
                raise ValueError(f"stop_regex={self.stop_regex!r} is not a regular expression ({e})") from None

    def _check_speculative(self) -> None:
        """The options self-speculation (method.md 16) cannot honour exactly, refused with one line each."""
        refused = [(self.repetition_penalty != 1.0, f"repetition_penalty={self.repetition_penalty} (a draft's "
                                                    f"verification would need the drafts before it in its context)"),
                   (self.length_penalty is not None, f"length_penalty={self.length_penalty}"),
                   (self.fht_cache_order, "fht_cache_order (drafts are verified and cached left to right)"),
                   (not self.infill_full_context, "infill_full_context=False (prefix-only infill)"),
                   (self.static_shapes, "static_shapes (a speculative step's chunk width varies)"),
                   (self.min_p > 0, f"min_p={self.min_p} (the drafts' distributions are not min_p-filtered)")]
        for bad, what in refused:
            if bad:
                raise ValueError(f"speculative=True does not combine with {what}")

    @classmethod
    def from_strings(cls, values: dict, base: "GenerationConfig | None" = None) -> "GenerationConfig":
        """Overrides given as strings (lm-eval ``model_args``, dotted CLI pairs), converted by the option's kind
        (typed values pass as they are); not validated (the caller validates the finished config once)."""
        unknown = [k for k in values if k not in OPTIONS]
        if unknown:
            raise ValueError(f"unknown generation option {unknown[0]!r}; options: {', '.join(OPTIONS)}")
        return replace(base or cls(), **{k: from_string(k, OPTIONS[k], v) for k, v in values.items()})


OPTIONS = options(GenerationConfig)     # name -> Option, in declaration order
# the bounded numbers: name -> (type, lowest, highest), inclusive; (type, None): nullable
BOUNDS = {name: ((int if o.kind == "int" else float, None) if o.nullable else (int if o.kind == "int" else float),
                 o.lo, o.hi) for name, o in OPTIONS.items() if o.kind in ("int", "float")}

REGENERATE = (".venv/bin/python -c 'from setdiff_mega.decoding.config import write_guide; write_guide()'"
              f"  # rewrites the options table of {GUIDE}")


def write_guide(path: str = GUIDE) -> None:
    """Rewrite the options table of ``path`` (docs/guide/decoding.md; run from the repository root)."""
    from pathlib import Path

    page = Path(path)
    page.write_text(with_table(page.read_text(), GenerationConfig))


__all__ = ["GenerationConfig", "OPTIONS", "BOUNDS", "MAX_TOKENS", "write_guide"]
