"""The scheduler: one loop owns the model and every decode; each step is one fused forward over every decode's
next call.

    loop:
        expire     queued jobs past their deadline fail (504); running ones are cancelled
        admit      queued jobs join while running < max_batch: a job whose options allow it takes a row of the
                   shared decode of its options and width bucket (the smallest power of two >= 64 holding
                   prompt + max_tokens; its prefill rides in that decode's next step), any other gets a private
                   decode (:mod:`.sessions`). A job alone (nothing else running or waiting) takes a one-row
                   shared decode instead, so one request at a time costs a step what ``generate`` at batch 1
                   costs (a ``max_batch``-row decode with one busy row pays its bookkeeping over every row); the
                   jobs that come while it runs share a ``max_batch``-row one, fused in the same forward
        sweep      finished jobs leave (EOS, stop string, max_tokens, cancellation, error); their rows are free
                   (a shared decode left without jobs waits, up to IDLE_DECODES of them, for the next job of its
                   options: its KV cache is not allocated again)
        calls      every decode's ``next_calls()`` (:mod:`setdiff_mega.decoding.calls`)
        step       the calls -> :func:`~setdiff_mega.decoding.calls.fused_forward` (cached and uncached calls
                   apart, joining rows' prefills apart where that saves padding: :mod:`.fusion`,
                   :mod:`.forwards`) -> each
                   decode's ``advance(logits)``: its rows' bookkeeping, its jobs' new text

Fairness: the queue is one FIFO per client, taken round-robin (:class:`~.bounded.FairQueue`): the next free row
goes to the next client in turn, so one client's flood never stands between another client and a row; and while
more than one client has work, no client holds more than its share of the rows (ceil(max_batch / active
clients) by default, ``row_share`` when set; a client alone the whole batch: :mod:`.admission`), so a light
client's row never decodes in a batch a flood filled.

Supervision: the loop's every turn beats its :class:`~.pulse.Pulse` (shared memory the HTTP side reads: /health, the
watchdog); every part of a step that runs a decode's or a client's code is guarded per decode (its jobs fail,
the loop goes on); anything else that escapes (a bug of the loop itself) ends the loop with its jobs failed in
one line, the pulse's state ``died``, ``on_death(message)`` called (:mod:`.supervision`): the engine is then
restarted or the server exits (:mod:`.watchdog`). A failed admission leaves no decode behind
(:meth:`Scheduler._orphan`).

No thread per request and no hand-off per step: the HTTP side only queues jobs (:meth:`Scheduler.submit`), flags
cancellations (:meth:`Scheduler.cancel`) and reads the events its jobs emit. Each decode has its own KV cache; a job
joining or leaving resets or frees its row only. The queue is bounded (``max_queue``: :class:`QueueFull`, HTTP 429).
Client disconnects and timeouts cancel a job: its row is retired before the next step. A failing forward fails the
jobs of the decodes in it (HTTP 500), a failing decode its own jobs, not the loop. After each loop iteration
``on_step_end`` (if set) runs: the engine hands the iteration's events to the HTTP side in one message
(:mod:`.outbox`, :mod:`.engine`; its time counts in the step's ``advance``). ``part_seconds`` accumulates each
step's time by part (:data:`PARTS`); everything but ``forward`` is the per-step host overhead (``host_seconds``),
the number that carries over to a GPU.
"""
from __future__ import annotations

import sys
import threading
import time

import torch

from .admission import RowShares
from .bounded import FairQueue
from .forwards import Clocked, fused_forwards
from .fusion import default_min_saving
from .job import Job
from .pulse import Pulse
from .sessions import USER, Decode, session_key
from .supervision import Supervised

# where a decode step's time goes: admitting and retiring jobs, the samplers' bookkeeping before the forward
# (next_calls), assembling the fused forward, the model forward itself, the bookkeeping after it (advance: token
# choice, commits, stopping, the jobs' new text)
PARTS = ("admit", "calls", "fuse", "forward", "advance")
MIN_WIDTH = 64                  # the narrowest shared decode (canvas positions)
IDLE_DECODES = 4                # shared decodes kept without jobs: a request of their options and width reuses one
                                # (its KV cache allocated and zeroed: at GPT-2-small shape ~12 ms per new decode)


class QueueFull(Exception):
    """The waiting queue is full (HTTP 429)."""


class Scheduler(Supervised):
    def __init__(self, model, tokenizer, method, *, max_batch: int = 8, max_queue: int = 256, metrics=None,
                 width: int = 4096, min_saving: int | None = None, pulse: Pulse | None = None,
                 row_share: int | None = None):
        """``row_share``: the rows one client may hold while others have work (None: ceil(max_batch / active
        clients): :mod:`.admission`). ``width``: the most canvas positions of a request (prompt plus
        ``max_tokens``); shared decodes are as wide as their requests need, by powers of two (:meth:`_bucket`).
        ``min_saving``: the padding (row x positions) a second forward in a step must save (:mod:`.fusion`; None:
        the device's default)."""
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_queue ({max_queue}) must be >= 1")
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.max_batch, self.max_queue, self.metrics = max_batch, max_queue, metrics
        self.device = next(model.parameters()).device
        self.min_saving = default_min_saving(self.device) if min_saving is None else int(min_saving)
        self.cond = threading.Condition()
        self.queue = FairQueue()         # waiting jobs, one FIFO per client, taken round-robin
        self.shares = RowShares(max_batch, row_share)     # how many rows each client may hold (.admission)
        self.running: dict[int, Job] = {}
        self.width = width
        self.decodes: list[Decode] = []
        self.shared: dict = {}           # (session key, width) -> its shared Decode
        self.resting: list = []          # shared decodes without jobs, oldest first (:data:`IDLE_DECODES`)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="setdiff-scheduler", daemon=True)
        self.pulse = pulse if pulse is not None else Pulse()
        self.error: str | None = None     # why the loop died (None while it runs)
        self.on_death = None              # called with that one line when it dies (the engine tells the HTTP side)
        self.fault: str | None = None     # a test's injected fault, acted on at the loop's next turn (_inject)
        self.steps = 0
        self.part_seconds = dict.fromkeys(PARTS, 0.0)   # decode-step time by part, summed (:data:`PARTS`)
        self.clock = Clocked(model)
        self.on_step_end = None          # called by the loop after each iteration (the server's event hand-over)
        self.stream_due = None           # () -> whether started streams' text goes out after this step (None: always)

    # -- the HTTP side ---------------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def close(self) -> None:
        with self.cond:
            self._closing = True
            for job in list(self.queue):
                job.fail(503, "the server is shutting down")
            self.queue.clear()
            for job in self.running.values():
                job.cancelled = True
            self.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (all or none: :class:`QueueFull`)."""
        with self.cond:
            if self._closing or self.error is not None:
                raise QueueFull(self.error or "the server is shutting down")
            if len(self.queue) + len(jobs) > self.max_queue:
                raise QueueFull(f"the queue is full ({len(self.queue)} waiting, limit {self.max_queue}); "
                                f"retry later")
            self.queue.extend(jobs)
            self._gauge()
            self.cond.notify_all()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop ``job`` (client gone, timeout): dropped from the queue, or retired before the next step."""
        with self.cond:
            if job in self.queue:
                self.queue.remove(job)
                job.reason = reason
                job.finish(None)
                self._gauge()
                return
            if job.key in self.running and job.reason is None and not job.done:
                job.reason = reason
                job.cancelled = True
                self.cond.notify_all()

    def in_loop(self) -> bool:
        """Whether the caller is the scheduler's loop (its events may wait for ``on_step_end``)."""
        return threading.current_thread() is self._thread

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called (new jobs are refused)."""
        return self._closing

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    # -- the loop ---------------------------------------------------------------------------------------
    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.occupancy(len(self.queue), len(self.running))

    def _committed(self, counts: list[int]) -> None:
        if self.metrics is not None:
            self.metrics.committed(counts)

    def _expire(self) -> None:
        now = time.monotonic()
        for job in [j for j in self.queue if j.deadline is not None and now > j.deadline]:
            self.queue.remove(job)
            job.fail(504, f"the request timed out after {job.timeout:g} s in the queue")
        for job in self.running.values():
            if job.deadline is not None and now > job.deadline and job.reason is None and not job.done:
                job.reason = "timeout"
                job.cancelled = True

    def _take(self) -> list[Job]:
        """Queued jobs that may start now (``cond`` held)."""
        jobs = self.shares.take(self.queue, self.running.values(), self.max_batch - len(self.running))
        now = time.monotonic()
        for job in jobs:
            job.started = now
        return jobs

    def _bucket(self, job: Job) -> int:
        """The canvas width of the shared decode ``job`` joins: the smallest power of two >= :data:`MIN_WIDTH`
        holding its positions (prompt + ``max_tokens``), at most ``width``. A step's bookkeeping costs in
        proportion to the width, so a short request never pays for the longest one the server admits."""
        need = len(job.ids) + job.config.max_new_tokens
        return min(self.width, max(MIN_WIDTH, 1 << max(0, need - 1).bit_length()))

    def _decode(self, job: Job, key, solo: bool = False) -> Decode:
        """The decode ``job`` runs in: private (``key`` None), else the shared one of its options, width bucket
        and size (one row for a job alone: ``solo``; ``max_batch`` rows otherwise), made when none has room."""
        kw = dict(rows=1 if solo else self.max_batch, device=self.device, committed=self._committed,
                  stream_due=lambda: self.stream_due is None or self.stream_due())
        if key is None:
            return Decode(self.method, self.model, self.tokenizer, job.config, job=job, width=self.width, **kw)
        key = (key, self._bucket(job), kw["rows"])
        d = self.shared.get(key)
        if d is None or not d.has_room():
            d = self.shared[key] = Decode(self.method, self.model, self.tokenizer, job.config, width=key[1], **kw)
        return d

    def _admit(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.running[job.key] = job
            key = session_key(job.config)
            solo = len(jobs) == 1 and len(self.running) == 1 and not self.queue
            d = None
            try:
                d = self._decode(job, key, solo)
                if key is not None:
                    d.admit(job)
            except Exception as e:            # noqa: BLE001 (one request's failure is reported, never raised)
                user = isinstance(e, USER)
                job.fail(400 if user else 500, str(e) if user else f"decoding failed: {type(e).__name__}: {e}")
                self._left([job])
                self._orphan(d)
                continue
            if d not in self.decodes:
                self.decodes.append(d)
            if d in self.resting:
                self.resting.remove(d)

    def _orphan(self, d: Decode | None) -> None:
        """After a failed admission: a decode made for it and left without jobs (outside ``decodes`` and
        ``resting``) is forgotten, its KV cache freed, so no failed request keeps one beyond the idle cap."""
        if d is None or d.slots or d in self.decodes or d in self.resting:
            return
        self.shared = {k: v for k, v in self.shared.items() if v is not d}

    def _left(self, jobs: list[Job]) -> None:
        with self.cond:
            for job in jobs:
                if self.running.pop(job.key, None) is None:
                    continue
                self.shares.left(job.client)
                if self.metrics is not None:
                    self.metrics.finished(job)
            self._gauge()

    def _drop(self, d: Decode, status: int, message: str) -> None:
        self._left(d.fail(status, message))
        if d in self.decodes:
            self.decodes.remove(d)
        for k, v in list(self.shared.items()):
            if v is d:
                del self.shared[k]

    def _sweep(self) -> None:
        for d in list(self.decodes):
            try:
                self._left(d.sweep())
            except Exception as e:            # noqa: BLE001 (a job's end failing: its decode's jobs fail)
                self._drop(d, 500, f"decoding failed: {type(e).__name__}: {e}")
                continue
            if not d.slots:
                if any(v is d for v in self.shared.values()):      # kept for the next job of its options
                    self.decodes.remove(d)
                    self.resting.append(d)
                    while len(self.resting) > IDLE_DECODES:
                        old = self.resting.pop(0)
                        self.shared = {k: v for k, v in self.shared.items() if v is not old}
                else:
                    self._drop(d, 500, "")

    @torch.inference_mode()
    def _loop(self) -> None:
        while True:
            self.pulse.beat(len(self.running), len(self.queue))
            if self.fault is not None:
                self._inject()
            with self.cond:
                if self._closing and not self.running:
                    return
                self._expire()
                jobs = [] if self._closing else self._take()
                if not jobs and not self.running:
                    self._end_step()                  # queued jobs that expired
                    self.cond.wait(timeout=0.05)
                    continue
            t0 = time.perf_counter()
            self._admit(jobs)
            self._sweep()
            stepped = self.decodes and self._step(time.perf_counter() - t0)
            t1 = time.perf_counter()
            self._end_step()
            if stepped:                           # handing the step's events over is the step's own host time
                self._add_part("advance", time.perf_counter() - t1)
            else:
                with self.cond:                   # nothing to compute (never expected with jobs running): no spin
                    self.cond.wait(timeout=0.005)

    def _add_part(self, name: str, seconds: float) -> None:
        self.part_seconds[name] += seconds
        if self.metrics is not None:
            self.metrics.part(name, seconds)

    def _end_step(self) -> None:
        self.pulse.beat(len(self.running), len(self.queue))     # before the hand-over: what a client sees next
        if self.on_step_end is not None:
            try:
                self.on_step_end()
            except Exception as e:            # noqa: BLE001 (the engine fails an unsendable event's job itself)
                print(f"error: the decode step's events could not be handed over: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)

    def _calls(self) -> list:
        out = []
        for d in list(self.decodes):
            try:
                calls = d.session.next_calls()
            except Exception as e:            # noqa: BLE001 (the decode's jobs fail; the server goes on)
                self._drop(d, 400 if isinstance(e, USER) else 500, f"decoding failed: {type(e).__name__}: {e}")
                continue
            if calls:
                out.append((d, calls))
        return out

    def _step(self, admitted: float) -> bool:
        """One step: every decode's calls, the fused forwards, every decode's bookkeeping; its time by part
        (:data:`PARTS`). False when no decode had work."""
        t1 = time.perf_counter()
        work = self._calls()
        t2 = time.perf_counter()
        self.clock.seconds = 0.0
        results = fused_forwards(work, self.clock, self.tokenizer.pad, self.min_saving, self._drop)
        t3 = time.perf_counter()
        for d, logits in results:
            try:
                d.session.advance(logits)
            except Exception as e:            # noqa: BLE001
                self._drop(d, 400 if isinstance(e, USER) else 500, f"decoding failed: {type(e).__name__}: {e}")
                continue
            del d.session.st.history[:-1]     # a long-lived decode keeps only the last step's counts
        t4 = time.perf_counter()
        self._sweep()
        t5 = time.perf_counter()
        if not work:
            return False
        self.pulse.stepped()
        fwd = self.clock.seconds
        parts = {"admit": admitted + (t5 - t4), "calls": t2 - t1, "fuse": (t3 - t2) - fwd, "forward": fwd,
                 "advance": t4 - t3}
        self.steps += 1
        for k, v in parts.items():
            self.part_seconds[k] += v
        if self.metrics is not None:
            self.metrics.step(sum(c.rows for _, cs in work for c in cs), sum(parts.values()), parts)
        return True

    @property
    def host_seconds(self) -> float:
        """Step time outside the model forwards, summed over the steps so far."""
        return sum(v for k, v in self.part_seconds.items() if k != "forward")


__all__ = ["Scheduler", "QueueFull"]
