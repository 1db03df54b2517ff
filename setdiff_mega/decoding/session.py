"""The decoding contract as code: :class:`Sampler` (what a method decodes with) and :class:`Session` (one batched
decode of a canvas), the bases of every sampler family (:mod:`.setdlm`, :mod:`.baselines`, :mod:`.speculative`).

A sampler holds the model, the special ids (MASK, PAD, EOS), the validated :class:`~.config.GenerationConfig`
(``config.validate()`` runs its checks once per config: a config its caller validated passes for free, an
unvalidated one is checked here, so none decodes unchecked), the tokenizer (stop strings), the checkpoint's order
prior (FHT cache order) and an ``observer``; ``session(canvas)`` starts a decode, ``generate(canvas)`` drives one to
its end (:func:`~.calls.drive`).

A session's typed state, shared by every family (the attributes declared on :class:`Session`)::

    st       DecodeState     canvas tokens / masked [B, N], per-row done, end, steps, options, generators
    choose   LogitsPipeline  processors -> token choice (per group of rows with equal options)
    runner   ChunkRunner     the [pending ; queries] forward through the KV cache (None: an uncached method)
    budget   int | None      tokens a forward may see (cache + chunk <= budget; the training length L by default)
    rule     str             which k tokens a step always commits (``commit_rule`` resolved for the method)
    nfe      int             forwards of an uncached method (a runner counts its own)

The protocol (:mod:`.calls`): ``next_calls()`` / ``advance(logits)`` run steps; between steps
``admit(b, ids, max_new_tokens, seed, options)`` rewrites a row of the canvas with a new request (the decode state,
the runner's cache window and the method's own row state, :meth:`Session._reset`, start again for that row only)
and ``retire(b)`` ends a row; ``output(rows)`` reads the decoded rows. A method writes its step (:meth:`_step`, a
generator) and its row hooks; everything above is shared.
"""
from __future__ import annotations

from .base import Canvas, DecodeState
from .calls import Stepper, drive
from .config import GenerationConfig
from .processors import LogitsPipeline
from .runner import ChunkRunner
from .sampling import resolve_rule


def context_budget(model, cfg: GenerationConfig) -> int | None:
    """Tokens a forward may see: the configured context length, else the model's training length."""
    return cfg.context_length or getattr(model, "training_length", None)


class Sampler:
    """What a method decodes with (module docstring); ``session_class`` is its :class:`Session`, :meth:`_refuse`
    the hook that refuses options the method cannot honour (one line)."""

    session_class: type | None = None

    def __init__(self, model, mask_id: int, pad_id: int, eos_id: int, config: GenerationConfig, tokenizer=None,
                 order_prior=None):
        self.model, self.mask_id, self.pad_id, self.eos_id = model, mask_id, pad_id, eos_id
        self.cfg = config.validate()   # free for a config validated by its caller (GenerationConfig.validate)
        self.tokenizer, self.order_prior = tokenizer, order_prior
        self.shift = bool(getattr(model, "shift_logits", False))
        self.observer = None           # called with the DecodeState after every step (DecodeState.observer)
        self._refuse()

    def _refuse(self) -> None:
        """Refuse options this method cannot decode with (ValueError, one line); nothing by default."""

    def session(self, canvas: Canvas) -> "Session":
        """A decode of ``canvas`` whose rows may be replaced by new requests between steps."""
        return self.session_class(self, canvas)

    def generate(self, canvas: Canvas):
        """Decode every row of ``canvas`` (:func:`~.calls.drive` over a session)."""
        session = self.session(canvas)
        drive(self.model, session)
        return session.output()


class Session(Stepper):
    """One batched decode (module docstring): the typed state every method shares, ``admit`` / ``retire`` /
    ``output``, and the hooks a method fills in: :meth:`_runner` (its chunk runner, None when uncached),
    :meth:`_reset` (row ``b`` joined: its method state starts again) and :meth:`_step` (one step, a generator)."""

    sampler: Sampler
    cfg: GenerationConfig
    canvas: Canvas
    st: DecodeState
    choose: LogitsPipeline
    runner: ChunkRunner | None
    budget: int | None
    rule: str
    nfe: int

    cached = True                      # the method decodes through a KV cache (a ChunkRunner)
    anchored = False                   # "auto" commit rule: the leftmost tokens (an AR-anchored model)

    def __init__(self, sampler: Sampler, canvas: Canvas):
        self.sampler, self.cfg, self.canvas = sampler, sampler.cfg, canvas
        cfg = self.cfg
        self.st = DecodeState(canvas, cfg, sampler.eos_id, sampler.mask_id, sampler.tokenizer, sampler.observer)
        self.choose = LogitsPipeline(cfg, sampler.mask_id, sampler.eos_id)
        self.budget = context_budget(sampler.model, cfg)
        self.rule = resolve_rule(cfg.commit_rule, anchored=self.anchored)
        self.nfe = 0
        self.runner = self._runner()

    def _runner(self) -> ChunkRunner | None:
        """The session's chunk runner (:mod:`.runner`), or None for an uncached method."""
        if not self.cached:
            return None
        s = self.sampler
        return ChunkRunner(s.model, self.st.tokens, s.mask_id, s.pad_id, self.cfg.use_cache, self.budget)

    def admit(self, b: int, ids: list[int], max_new_tokens: int, seed: int | None = None, options=None) -> None:
        """Row ``b`` (finished) decodes request ``ids`` from the next step on (its sampling stream from ``seed``,
        its sampling ``options``: :class:`~.sampling.RowOptions`); the other rows are untouched."""
        if self.in_step:
            raise RuntimeError("a row joins between steps, not while a step's call is out")
        s = self.sampler
        self.canvas.put_row(b, ids, s.mask_id, s.pad_id, max_new_tokens)
        self.st.reset_row(b, seed, options)
        if self.runner is not None:
            self.runner.reset_row(b)
        self._reset(b)

    def _reset(self, b: int) -> None:
        """Row ``b`` holds a new request (the canvas and the decode state already rewritten): the method's own
        state of that row starts again."""

    def retire(self, b: int) -> None:
        """Row ``b`` stops decoding now (a cancelled request); its slot may be admitted again."""
        self.st.done[b] = True

    def output(self, rows: slice = slice(None)):
        """The decoded rows so far (:meth:`~.base.DecodeState.output`)."""
        r = self.runner
        return self.st.output(self.nfe if r is None else r.nfe, 0 if r is None else r.evicted, rows=rows)


__all__ = ["Sampler", "Session", "context_budget"]
