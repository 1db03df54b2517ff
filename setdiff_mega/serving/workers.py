"""The decoding threads of the scheduler: each runs samplers against the :class:`~.fusion.BatchedModel`, so its
model calls park in the :class:`~.fusion.StepHub` and run fused with the other threads' calls.

* :class:`SessionWorker`: one batched decode over ``max_batch`` slot rows that jobs join and leave between
  steps (a sampler with ``session()``: SetDLM; :class:`~setdiff_mega.decoding.setdlm.SetDLMSession`). Jobs
  share a session when their decoding options agree except ``max_new_tokens`` (and the seed, for greedy
  decoding without FHT orders): the row bookkeeping of a step is then one set of batched tensor operations
  for all of them. A job joins at its slot (its prefill rides in the next step), leaves when its row is done
  (its output read from the row) or when cancelled (client gone, timeout, a stop string in its text).
* :class:`SoloWorker`: one job through its sampler's ``generate`` (AR, BD3LM, MDLM; sampled SetDLM jobs,
  whose random draws must not depend on other rows): its forwards still fuse with everyone else's.

Either reports a finished job through ``done(job)`` (the scheduler retires it before the next step).
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from setdiff_mega.decoding.base import Canvas
from setdiff_mega.decoding.context import ContextOverflow
from setdiff_mega.errors import RequestError
from setdiff_mega.inference.api import build_sampler

from .fusion import Cancelled

_sessions = itertools.count()
USER = (RequestError, ContextOverflow, ValueError)


def session_key(sampler_cls, cfg) -> str | None:
    """The options a job's session must share, as a key (None: the job decodes alone)."""
    if not hasattr(sampler_cls, "session") or cfg.temperature > 0 or cfg.record or cfg.static_shapes \
            or not cfg.use_cache:
        return None
    seed = cfg.seed if cfg.fht_cache_order else 0
    return repr(replace(cfg, max_new_tokens=0, seed=seed))


class SoloWorker:
    def __init__(self, sched, job):
        self.sched, self.job, self.key = sched, job, job.key

    def run(self) -> None:
        s, job = self.sched, self.job
        s.hub.bind(self.key)
        try:
            sampler = build_sampler(s.method, s.proxy, s.tokenizer, job.config)

            def observe(st):
                if job.observe(st):
                    raise Cancelled()             # a stop string ended the text
                s.committed(job.committed_last)
            sampler.observer = observe
            canvas = Canvas.from_prompts([job.ids], s.tokenizer.mask, s.tokenizer.pad, job.config.max_new_tokens,
                                         device=s.device)
            job.finish(sampler.generate(canvas))
        except Cancelled:
            job.finish(None)
        except USER as e:
            job.fail(400, str(e))
        except Exception as e:                # noqa: BLE001 (one request's failure is reported, never raised)
            job.fail(500, f"decoding failed: {type(e).__name__}: {e}")
        finally:
            s.done(job)
            s.hub.leave()


class SessionWorker:
    def __init__(self, sched, config):
        self.sched, self.config = sched, config         # the options every job of the session shares
        self.key = ("session", next(_sessions))
        self.inbox: list = []                 # jobs handed over by the scheduler (under its lock)
        self.slots: dict = {}                 # canvas row -> job
        self.closed = False
        self.session = None

    def has_room(self) -> bool:
        return not self.closed and len(self.slots) + len(self.inbox) < self.sched.max_batch

    def _observe(self, st) -> None:
        for b, job in self.slots.items():
            if not job.done and job.observe(st, b):
                job.cancelled = True          # a stop string: the text is complete
            self.sched.committed(job.committed_last)

    def _admit(self, jobs) -> None:
        for job in jobs:
            b = next(b for b in range(self.sched.max_batch) if b not in self.slots)
            try:
                self.session.admit(b, job.ids, job.config.max_new_tokens)
                self.slots[b] = job
            except USER as e:
                job.fail(400, str(e))
                self.sched.done(job)

    def _sweep(self, final: bool = False) -> None:
        """Jobs whose row is done leave with its output; cancelled ones with what they emitted."""
        st = self.session.st
        for b, job in list(self.slots.items()):
            if job.cancelled or final:
                self.session.retire(b)
                job.finish(None)
            elif bool(st.done[b]):
                job.finish(st.output(self.session.runner.nfe, rows=slice(b, b + 1)))
            else:
                continue
            del self.slots[b]
            self.sched.done(job)

    def run(self) -> None:
        s, cond = self.sched, self.sched.hub.cond
        s.hub.bind(self.key)
        try:
            cfg = replace(self.config, max_new_tokens=1)
            sampler = build_sampler(s.method, s.proxy, s.tokenizer, cfg)
            sampler.observer = self._observe
            self.session = sampler.session(Canvas.empty(s.max_batch, s.width, s.tokenizer.pad, device=s.device))
            while True:
                with cond:
                    jobs, self.inbox = self.inbox, []
                    if not jobs and not self.slots:
                        self.closed = True
                        return
                self._admit(jobs)
                self._sweep()
                if self.slots and not self.session.step():
                    self._sweep(final=True)
                del self.session.st.history[:-1]      # a long-lived session keeps only the last step's counts
                self._sweep()
        except Exception as e:                # noqa: BLE001 (the session's jobs fail; the server goes on)
            status = 400 if isinstance(e, USER) else 500
            with cond:
                self.closed = True
                jobs, self.inbox = list(self.slots.values()) + self.inbox, []
            for job in jobs:
                if not job.done:
                    job.fail(status, f"decoding failed: {type(e).__name__}: {e}")
                    s.done(job)
        finally:
            s.hub.leave()


__all__ = ["SessionWorker", "SoloWorker", "session_key"]
