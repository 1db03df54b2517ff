"""The decodes the scheduler runs: each a sampler's session (:mod:`setdiff_mega.decoding.calls`: a state machine
of steps) with the jobs that occupy its rows.

* A **shared** decode: ``max_batch`` slot rows of width ``width`` that jobs join and leave between steps. Jobs
  share one when their decoding options agree except ``max_new_tokens``, the seed (each row samples from its
  own stream, seeded by its request; FHT orders excepted, drawn from the session's seed) and the sampling
  options ``temperature``, ``top_p``, ``min_p``, ``repetition_penalty`` (each row's own: the token choice runs once per
  group of rows with equal options, :class:`~setdiff_mega.decoding.processors.LogitsPipeline`): a step's
  bookkeeping is then one set of batched tensor operations for all of them, greedy or sampled, and rows
  without work are left out of its forward.
* A **private** decode: one job, its canvas exactly as ``generate`` builds it (``record``, ``static_shapes``,
  uncached decoding).

Either way the decode's model calls are the scheduler's to run (fused with every other decode's); after each
step the decode's :class:`~setdiff_mega.decoding.base.DecodeState` is shown to its jobs (:meth:`Job.observe`),
and :meth:`Decode.sweep` hands finished rows' outputs to their jobs and frees the rows.
"""
from __future__ import annotations

from dataclasses import asdict, replace

import torch

from setdiff_mega.decoding.base import Canvas, first_true
from setdiff_mega.decoding.context import ContextOverflow
from setdiff_mega.decoding.sampling import RowOptions
from setdiff_mega.decoding.trace import traces
from setdiff_mega.errors import RequestError
from setdiff_mega.inference.api import build_sampler

USER = (RequestError, ContextOverflow, ValueError)


def session_key(cfg) -> str | None:
    """The options a job's shared decode must agree on, as a key (None: the job decodes privately). The seed and
    the sampling options are a row's own, except the seed of FHT cache orders, whose times the session draws
    from it."""
    if cfg.record or cfg.static_shapes or not cfg.use_cache:
        return None
    seed = cfg.seed if cfg.fht_cache_order else 0
    return repr(replace(cfg, max_new_tokens=0, seed=seed, temperature=0.0, top_p=1.0, min_p=0.0,
                        repetition_penalty=1.0))


class Decode:
    """A session and the jobs in its rows (module docstring); ``committed(counts)`` reports a step's committed
    tokens per busy row."""

    def __init__(self, method, model, tokenizer, config, *, rows: int, width: int, device, committed,
                 job=None, stream_due=None):
        """``stream_due()``: whether more text of started streams would be handed over after this step (None:
        always); when not, :meth:`_observe` leaves their new text for a later step."""
        self.rows, self.committed, self.stream_due = rows, committed, stream_due
        self.method_name = getattr(method, "name", method)
        self.slots: dict = {}                       # row -> job
        shared = job is None
        # a shared decode's config: its first job's (validated once, by the server), derived (each job's own
        # max_new_tokens lays out its row at admit)
        sampler = build_sampler(method, model, tokenizer, config.derive(max_new_tokens=1) if shared else config)
        sampler.observer = self._observe
        if shared:
            canvas = Canvas.empty(rows, width, tokenizer.pad, device=device)
        else:
            canvas = Canvas.from_prompts([job.ids], tokenizer.mask, tokenizer.pad, config.max_new_tokens,
                                         device=device)
            self.slots[0] = job
        self.shared = shared
        self.width = canvas.tokens.shape[1]         # canvas positions per row (the KV budget's unit: .kvbudget)
        self.session = sampler.session(canvas)

    def has_room(self) -> bool:
        return self.shared and len(self.slots) < self.rows

    def admit(self, job) -> None:
        """``job`` takes a free row from the next step on (a user error fails it alone: 400)."""
        b = next(b for b in range(self.rows) if b not in self.slots)
        self.session.admit(b, job.ids, job.config.max_new_tokens, job.config.seed, RowOptions.of(job.config))
        self.slots[b] = job

    def _observe(self, st) -> None:
        """After every step: each job's committed count, and the tokens that became final in the rows that stream
        (module docstring of :mod:`.job`), found for all rows at once: with g the row's generation start and f its
        leftmost masked position, the final tokens are the generated positions before f. A started stream's new
        text is found only on steps after which it would be handed over (``stream_due``: the server's
        ``--stream-interval``), its first text and a job with stop strings every step; a job's end hands over its
        whole text (:meth:`Job.finish`), so nothing is lost, only found less often."""
        counts = st.history[-1] if st.history else [0] * st.tokens.shape[0]
        for b, job in self.slots.items():
            job.committed_last = int(counts[b])
            job.steps += job.committed_last > 0
            if job.trace and st.commit_step is not None:
                self._trace_step(st, b, job)
        self.committed([int(counts[b]) for b in self.slots])
        due = self.stream_due is None or self.stream_due()
        rows = [b for b, job in self.slots.items() if job.streaming and (due or job.first_token is None or job.stops)]
        if not rows:
            return
        cv = st.canvas
        f = first_true(st.masked & cv.generate)
        final = (cv.generate & (st.pos[None] < f[:, None])).sum(1)
        n, g, done = torch.stack([final, first_true(cv.generate), st.done.long()]).tolist()   # one host sync
        rows = [b for b in rows if not done[b] and n[b] > len(self.slots[b].tokens)]
        news = self._new_tokens(st, rows, n, g)
        for b in rows:
            if self.slots[b].extend(news[b]):
                self.slots[b].cancelled = True        # a stop string: the text is complete

    def _new_tokens(self, st, rows: list, n: list, g: list) -> dict:
        """row -> its final tokens after the ``len(job.tokens)`` it has streamed, up to n[row]: rows generating one
        contiguous region from g (the usual) read one copy of the columns spanning all their news; infilling rows
        (MASK spans) take their generated positions in order."""
        cv, out = st.canvas, {}
        plain = [b for b in rows if not bool(cv.infill[b])] if bool(cv.infill.any()) else rows
        if plain:
            start = {b: g[b] + len(self.slots[b].tokens) for b in plain}
            lo, hi = min(start.values()), max(g[b] + n[b] for b in plain)
            block = st.tokens[plain, lo:hi].tolist()
            out = {b: row[start[b] - lo:g[b] + n[b] - lo] for b, row in zip(plain, block)}
        for b in rows:
            if b not in out:
                out[b] = st.tokens[b][cv.generate[b]][len(self.slots[b].tokens):n[b]].tolist()
        return out

    def _trace_step(self, st, b: int, job) -> None:
        """A traced job's commits of the step just taken (its decode is recorded: private, ``record``)."""
        s = st.commit_calls - 1
        pos = (st.commit_step[b] == s).nonzero()[:, 0].tolist()
        toks = st.tokens[b, pos].tolist()
        step = {"step": s, "positions": pos, "tokens": toks, "texts": [job.tokenizer.decode([t]) for t in toks],
                "confidences": [round(float(c), 5) for c in st.conf[b, pos].tolist()]}
        if not job.trace_started:                  # the first: every position the job will fill
            step["region"] = st.canvas.generate[b].nonzero()[:, 0].tolist()
            job.trace_started = True
        job.emit("trace", step)

    def _trace_record(self, b: int, job, out) -> None:
        cv = self.session.st.canvas
        row = Canvas(cv.tokens[b:b + 1], cv.generate[b:b + 1], cv.valid[b:b + 1], cv.infill[b:b + 1])
        t = traces(self.method_name, row, out, job.config)[0]
        t.texts = [job.tokenizer.decode([x]) for x in t.tokens]
        job.trace_record = asdict(t)

    def sweep(self) -> list:
        """Jobs whose row is done leave with its output, cancelled ones with what they emitted; returns them."""
        st, left = self.session.st, []
        done = st.done.tolist() if self.slots else []       # one host sync
        for b, job in list(self.slots.items()):
            if job.cancelled:
                self.session.retire(b)
                job.finish(None)
            elif done[b]:
                out = self.session.output(rows=slice(b, b + 1))
                if job.trace and out.commit_steps:
                    self._trace_record(b, job, out)
                job.finish(out)
            else:
                continue
            del self.slots[b]
            left.append(job)
        return left

    def fail(self, status: int, message: str) -> list:
        """Every job of the decode fails (the decode is dropped); returns them."""
        jobs, self.slots = list(self.slots.values()), {}
        for job in jobs:
            if not job.done:
                job.fail(status, message)
        return jobs


__all__ = ["Decode", "session_key", "USER"]
