"""The scheduler: one loop owns the model and every decode; each step is one fused forward over every decode's
next call. It joins the admission policy (:mod:`.admission`: who may start) and the execution (:mod:`.execution`:
the decodes and their steps):

    loop:
        expire     queued jobs past their deadline fail (504); running ones are cancelled      (admission)
        admit      queued jobs join while rows are free: the clients in turn, none beyond its row share
                   (admission); each takes a row of a shared decode, or a private decode        (execution)
        sweep      finished jobs leave; their rows are free                                     (execution)
        step       every decode's calls -> the fused forwards -> every decode's bookkeeping     (execution)
        hand-over  ``on_step_end`` (the engine's: the step's events to the HTTP side in one message, :mod:`.outbox`,
                   :mod:`.engine_process`; its time counts in the step's ``advance``)

Fairness: the queue is one FIFO per client, taken round-robin; while more than one client has work, no client
holds more than its share of the rows (ceil(max_batch / active clients) by default, ``row_share`` when set; a
client alone the whole batch: :mod:`.admission`), so a light client's row never decodes in a batch a flood filled.
KV caches: every decode's, live and resting, within one budget (:mod:`.kvbudget`; ``kv_positions``).

Supervision: the loop's every turn beats its :class:`~.pulse.Pulse` (shared memory the HTTP side reads: /health, the
watchdog); every part of a step that runs a decode's or a client's code is guarded per decode (its jobs fail,
the loop goes on); anything else that escapes (a bug of the loop itself) ends the loop with its jobs failed in
one line, the pulse's state ``died``, ``on_death(message)`` called (:mod:`.supervision`): the engine is then
restarted or the server exits (:mod:`.watchdog`).

No thread per request and no hand-off per step: the HTTP side only queues jobs (:meth:`Scheduler.submit`), flags
cancellations (:meth:`Scheduler.cancel`) and reads the events its jobs emit. The queue is bounded (``max_queue``:
:class:`~.messages.QueueFull`, HTTP 429). Client disconnects and timeouts cancel a job: its row is retired before
the next step.
"""
from __future__ import annotations

import sys
import threading
import time

import torch

from .admission import Admission
from .execution import PARTS, Execution
from .job import Job
from .messages import QueueFull
from .pulse import Pulse
from .supervision import Supervised


class Scheduler(Supervised):
    def __init__(self, model, tokenizer, method, *, max_batch: int = 8, max_queue: int = 256, metrics=None,
                 width: int = 4096, min_saving: int | None = None, pulse: Pulse | None = None,
                 row_share: int | None = None, kv_positions: int | None = None):
        """``row_share``: the rows one client may hold while others have work (None: ceil(max_batch / active
        clients): :mod:`.admission`). ``width``: the most canvas positions of a request (prompt plus
        ``max_tokens``); shared decodes are as wide as their requests need, by powers of two
        (:meth:`~.execution.Execution.bucket`). ``min_saving``: the padding (row x positions) a second forward in
        a step must save (:mod:`.fusion`; None: the device's default). ``kv_positions``: the KV-cache budget in
        canvas positions over all decodes (:mod:`.kvbudget`; None: only the idle cap)."""
        self.admission = Admission(max_batch, max_queue, row_share)
        self.execution = Execution(model, tokenizer, method, max_batch=max_batch, width=width,
                                   min_saving=min_saving, left=self._left, due=self._due, metrics=metrics,
                                   kv_positions=kv_positions)
        self.model, self.tokenizer, self.method, self.metrics = model, tokenizer, method, metrics
        self.max_batch, self.max_queue, self.width = max_batch, max_queue, width
        self.cond = threading.Condition()
        self.running: dict[int, Job] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="setdiff-scheduler", daemon=True)
        self.pulse = pulse if pulse is not None else Pulse()
        self.error: str | None = None     # why the loop died (None while it runs)
        self.on_death = None              # called with that one line when it dies (the engine tells the HTTP side)
        self.fault: str | None = None     # a test's injected fault, acted on at the loop's next turn (_inject)
        self.on_step_end = None          # called by the loop after each iteration (the server's event hand-over)
        self.stream_due = None           # () -> whether started streams' text goes out after this step (None: always)

    # what the admission and the execution hold, as the engine and the tests read it
    queue = property(lambda self: self.admission.queue)
    shares = property(lambda self: self.admission.shares)
    decodes = property(lambda self: self.execution.decodes)
    shared = property(lambda self: self.execution.budget.shared)
    resting = property(lambda self: self.execution.budget.resting)
    steps = property(lambda self: self.execution.steps)
    part_seconds = property(lambda self: self.execution.part_seconds)
    host_seconds = property(lambda self: self.execution.host_seconds)

    def _bucket(self, job: Job) -> int:
        return self.execution.bucket(job)

    def _due(self) -> bool:
        return self.stream_due is None or self.stream_due()

    # -- the HTTP side ---------------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def close(self) -> None:
        with self.cond:
            self._closing = True
            self.admission.close()
            for job in self.running.values():
                job.cancelled = True
            self.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (all or none: :class:`~.messages.QueueFull`)."""
        with self.cond:
            refusal = (self.error or "the server is shutting down") if self._closing or self.error else None
            self.admission.submit(jobs, refusal)
            self._gauge()
            self.cond.notify_all()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop ``job`` (client gone, timeout): dropped from the queue, or retired before the next step."""
        with self.cond:
            if self.admission.withdraw(job, reason):
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

    def _left(self, jobs: list[Job]) -> None:
        with self.cond:
            for job in jobs:
                if self.running.pop(job.key, None) is None:
                    continue
                self.shares.left(job.client)
                if self.metrics is not None:
                    self.metrics.finished(job)
            self._gauge()

    def _admit(self, jobs: list[Job]) -> None:
        """``jobs`` (taken from the queue) run from now on; one alone, with none else running or waiting, takes a
        one-row decode (:mod:`.execution`)."""
        for job in jobs:
            self.running[job.key] = job
        self.execution.admit(jobs, len(self.running) == len(jobs) and not self.queue)

    @torch.inference_mode()
    def _loop(self) -> None:
        while True:
            self.pulse.beat(len(self.running), len(self.queue))
            if self.fault is not None:
                self._inject()
            with self.cond:
                if self._closing and not self.running:
                    return
                self.admission.expire(self.running.values())
                jobs = [] if self._closing else self.admission.take(self.running)
                if not jobs and not self.running:
                    self._end_step()                  # queued jobs that expired
                    self.cond.wait(timeout=0.05)
                    continue
            t0 = time.perf_counter()
            self._admit(jobs)
            self.execution.sweep()
            stepped = self.decodes and self.execution.step(time.perf_counter() - t0)
            if stepped:
                self.pulse.stepped()
            t1 = time.perf_counter()
            self._end_step()
            if stepped:                           # handing the step's events over is the step's own host time
                self.execution.add_part("advance", time.perf_counter() - t1)
            else:
                with self.cond:                   # nothing to compute (never expected with jobs running): no spin
                    self.cond.wait(timeout=0.005)

    def _end_step(self) -> None:
        self.pulse.beat(len(self.running), len(self.queue))     # before the hand-over: what a client sees next
        if self.on_step_end is not None:
            try:
                self.on_step_end()
            except Exception as e:            # noqa: BLE001 (the engine fails an unsendable event's job itself)
                print(f"error: the decode step's events could not be handed over: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)


__all__ = ["Scheduler", "QueueFull", "PARTS"]
