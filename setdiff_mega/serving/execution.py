"""Execution: the decodes the scheduler's loop runs and one step over all of them; no policy about who runs.

The admission policy (:mod:`.admission`) hands over the jobs that start; here they take rows and every decode
advances by one step:

    admit      a job whose options allow it takes a row of the shared decode of its options and width bucket (the
               smallest power of two >= :data:`MIN_WIDTH` holding prompt + max_tokens; its prefill rides in that
               decode's next step), any other gets a private decode (:mod:`.sessions`). A job alone (nothing else
               running or waiting) takes a one-row shared decode instead, so one request at a time costs a step
               what ``generate`` at batch 1 costs; the jobs that come while it runs share a ``max_batch``-row one,
               fused in the same forward. A failed admission fails its job alone and leaves no decode behind
    sweep      finished jobs leave (EOS, stop string, max_tokens, cancellation, error); a shared decode left
               without jobs rests within the KV-cache budget (:mod:`.kvbudget`), any other is dropped
    calls      every decode's ``next_calls()`` (:mod:`setdiff_mega.decoding.calls`)
    step       the calls -> fused forwards (:mod:`.forwards`, :mod:`.fusion`) -> each decode's ``advance(logits)``

Every part that runs a decode's or a client's code is guarded per decode: its jobs fail (400 for a user's error,
500 otherwise), the others go on. ``part_seconds`` accumulates each step's time by part (:data:`PARTS`);
everything but ``forward`` is the per-step host overhead (``host_seconds``), the number that carries over to a GPU.
"""
from __future__ import annotations

import time

from .forwards import Clocked, fused_forwards
from .fusion import default_min_saving
from .job import Job
from .kvbudget import KVBudget
from .sessions import USER, Decode, session_key

# where a decode step's time goes: admitting and retiring jobs, the samplers' bookkeeping before the forward
# (next_calls), assembling the fused forward, the model forward itself, the bookkeeping after it (advance: token
# choice, commits, stopping, the jobs' new text)
PARTS = ("admit", "calls", "fuse", "forward", "advance")
MIN_WIDTH = 64                  # the narrowest shared decode (canvas positions)


class Execution:
    """The decodes and their steps (module docstring). ``left(jobs)``: jobs that ended here leave the running
    set; ``due()``: whether started streams' text goes out after this step; ``metrics``: the engine's
    (:class:`~.metrics.Metrics`) or None."""

    def __init__(self, model, tokenizer, method, *, max_batch: int, width: int, min_saving: int | None, left, due,
                 metrics=None, kv_positions: int | None = None):
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.max_batch, self.width, self.left, self.due, self.metrics = max_batch, width, left, due, metrics
        self.device = next(model.parameters()).device
        self.min_saving = default_min_saving(self.device) if min_saving is None else int(min_saving)
        self.decodes: list[Decode] = []  # the live ones (with jobs)
        self.budget = KVBudget(kv_positions)
        self.steps = 0
        self.part_seconds = dict.fromkeys(PARTS, 0.0)   # decode-step time by part, summed (:data:`PARTS`)
        self.clock = Clocked(model)

    def bucket(self, job: Job) -> int:
        """The canvas width of the shared decode ``job`` joins: the smallest power of two >= :data:`MIN_WIDTH`
        holding its positions (prompt + ``max_tokens``), at most ``width``. A step's bookkeeping costs in
        proportion to the width, so a short request never pays for the longest one the server admits."""
        need = len(job.ids) + job.config.max_new_tokens
        return min(self.width, max(MIN_WIDTH, 1 << max(0, need - 1).bit_length()))

    def _committed(self, counts: list[int]) -> None:
        if self.metrics is not None:
            self.metrics.committed(counts)

    def _decode(self, job: Job, key, solo: bool = False) -> Decode:
        """The decode ``job`` runs in: private (``key`` None), else the shared one of its options, width bucket
        and size (one row for a job alone: ``solo``; ``max_batch`` rows otherwise), made when none has room."""
        kw = dict(rows=1 if solo else self.max_batch, device=self.device, committed=self._committed,
                  stream_due=self.due)
        if key is None:
            return Decode(self.method, self.model, self.tokenizer, job.config, job=job, width=self.width, **kw)
        key = (key, self.bucket(job), kw["rows"])
        d = self.budget.find(key)
        if d is None:
            d = Decode(self.method, self.model, self.tokenizer, job.config, width=key[1], **kw)
            self.budget.register(key, d)
        return d

    def admit(self, jobs: list[Job], alone: bool) -> None:
        """``jobs`` take rows (``alone``: the only job running and none waiting: a one-row decode)."""
        for job in jobs:
            key = session_key(job.config)
            d = None
            try:
                d = self._decode(job, key, alone and len(jobs) == 1)
                if key is not None:
                    d.admit(job)
            except Exception as e:            # noqa: BLE001 (one request's failure is reported, never raised)
                user = isinstance(e, USER)
                job.fail(400 if user else 500, str(e) if user else f"decoding failed: {type(e).__name__}: {e}")
                self.left([job])
                self._orphan(d)
                continue
            if d not in self.decodes:
                self.decodes.append(d)
            self.budget.wake(d)

    def _orphan(self, d: Decode | None) -> None:
        """After a failed admission: a decode made for it and left without jobs (neither live nor resting) is
        forgotten, its KV cache freed, so no failed request keeps one beyond the budget."""
        if d is None or d.slots or d in self.decodes or d in self.budget.resting:
            return
        self.budget.forget(d)

    def drop(self, d: Decode, status: int, message: str) -> None:
        """``d`` fails its jobs with (``status``, ``message``) and is gone."""
        self.left(d.fail(status, message))
        if d in self.decodes:
            self.decodes.remove(d)
        self.budget.forget(d)

    def sweep(self) -> None:
        for d in list(self.decodes):
            try:
                self.left(d.sweep())
            except Exception as e:            # noqa: BLE001 (a job's end failing: its decode's jobs fail)
                self.drop(d, 500, f"decoding failed: {type(e).__name__}: {e}")
                continue
            if not d.slots:
                if self.budget.registered(d):                      # kept for the next job of its options
                    self.decodes.remove(d)
                    self.budget.rest(d, self.decodes)
                else:
                    self.drop(d, 500, "")

    def _calls(self) -> list:
        out = []
        for d in list(self.decodes):
            try:
                calls = d.session.next_calls()
            except Exception as e:            # noqa: BLE001 (the decode's jobs fail; the server goes on)
                self.drop(d, 400 if isinstance(e, USER) else 500, f"decoding failed: {type(e).__name__}: {e}")
                continue
            if calls:
                out.append((d, calls))
        return out

    def step(self, admitted: float) -> bool:
        """One step: every decode's calls, the fused forwards, every decode's bookkeeping; its time by part
        (:data:`PARTS`, ``admitted``: the admission's seconds). False when no decode had work."""
        t1 = time.perf_counter()
        work = self._calls()
        t2 = time.perf_counter()
        self.clock.seconds = 0.0
        results = fused_forwards(work, self.clock, self.tokenizer.pad, self.min_saving, self.drop)
        t3 = time.perf_counter()
        for d, logits in results:
            try:
                d.session.advance(logits)
            except Exception as e:            # noqa: BLE001
                self.drop(d, 400 if isinstance(e, USER) else 500, f"decoding failed: {type(e).__name__}: {e}")
                continue
            del d.session.st.history[:-1]     # a long-lived decode keeps only the last step's counts
        t4 = time.perf_counter()
        self.sweep()
        t5 = time.perf_counter()
        if not work:
            return False
        fwd = self.clock.seconds
        parts = {"admit": admitted + (t5 - t4), "calls": t2 - t1, "fuse": (t3 - t2) - fwd, "forward": fwd,
                 "advance": t4 - t3}
        self.steps += 1
        for k, v in parts.items():
            self.part_seconds[k] += v
        if self.metrics is not None:
            self.metrics.step(sum(c.rows for _, cs in work for c in cs), sum(parts.values()), parts)
        return True

    def add_part(self, name: str, seconds: float) -> None:
        self.part_seconds[name] += seconds
        if self.metrics is not None:
            self.metrics.part(name, seconds)

    @property
    def host_seconds(self) -> float:
        """Step time outside the model forwards, summed over the steps so far."""
        return sum(v for k, v in self.part_seconds.items() if k != "forward")


__all__ = ["Execution", "PARTS", "MIN_WIDTH"]
