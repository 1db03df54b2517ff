"""The scheduler: one loop owns the model and runs every decoding thread's next call as one fused forward.

    loop:
        expire     queued jobs past their deadline fail (504); running ones are cancelled
        admit      queued jobs join while running < max_batch: a job whose options allow it joins the
                   :class:`~.workers.SessionWorker` of its options (a slot of one batched SetDLM decode; its
                   prefill rides in that session's next step), any other starts a :class:`~.workers.SoloWorker`
        wait       until every decoding thread is parked in a model call or has finished
        retire     finished jobs leave (EOS, stop string, max_tokens, cancellation, error)
        step       the parked calls -> :func:`~.fusion.fused_forward` (cached and uncached calls apart) -> each
                   thread gets its logits and runs its rows' bookkeeping up to its next call

Each session (and each solo job) has its own KV cache; a job joining or leaving a session resets or frees
its row only (:meth:`~setdiff_mega.decoding.setdlm.SetDLMSession.admit`). The queue is bounded
(``max_queue``: :class:`QueueFull`, HTTP 429). Client disconnects and timeouts cancel a job: a session
retires its row before its next step, a solo job's thread raises :class:`~.fusion.Cancelled` at its next
model call. A failing forward fails the jobs in it (HTTP 500), not the loop.
"""
from __future__ import annotations

import collections
import threading
import time

import torch

from setdiff_mega import methods

from .fusion import BatchedModel, StepHub, fused_forward
from .job import Job
from .workers import SessionWorker, SoloWorker, session_key


class QueueFull(Exception):
    """The waiting queue is full (HTTP 429)."""


class Scheduler:
    def __init__(self, model, tokenizer, method, *, max_batch: int = 8, max_queue: int = 256, metrics=None,
                 width: int = 4096):
        """``width``: a session's canvas positions (the longest prompt plus ``max_tokens`` it admits)."""
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_queue ({max_queue}) must be >= 1")
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.max_batch, self.max_queue, self.metrics = max_batch, max_queue, metrics
        self.hub = StepHub()
        self.proxy = BatchedModel(model, self.hub)
        self.device = next(model.parameters()).device
        self.queue: collections.deque = collections.deque()
        self.running: dict[int, Job] = {}
        self.left: set = set()           # keys of jobs that finished
        self.width = width
        self.sessions: dict = {}         # session key -> SessionWorker
        self.worker_of: dict = {}        # job key -> its SessionWorker (session jobs)
        name = getattr(method, "name", method)
        self.sampler_cls = methods.get(name).sampler_class()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="setdiff-scheduler", daemon=True)
        self.steps = 0

    # -- the HTTP side ---------------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def close(self) -> None:
        with self.hub.cond:
            self._closing = True
            for job in list(self.queue):
                job.fail(503, "the server is shutting down")
            self.queue.clear()
            for job in list(self.running.values()):
                self._stop(job)
            self.hub.cond.notify_all()
        self._thread.join(timeout=10)

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (all or none: :class:`QueueFull`)."""
        with self.hub.cond:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self.queue) + len(jobs) > self.max_queue:
                raise QueueFull(f"the queue is full ({len(self.queue)} waiting, limit {self.max_queue}); "
                                f"retry later")
            self.queue.extend(jobs)
            self._gauge()
            self.hub.cond.notify_all()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop ``job`` (client gone, timeout): dropped from the queue, or cancelled at its next step."""
        with self.hub.cond:
            if job in self.queue:
                self.queue.remove(job)
                job.reason = reason
                job.finish(None)
                self._gauge()
                return
            if job.key in self.running and job.reason is None and not job.done:
                job.reason = reason
                self._stop(job)

    def _stop(self, job: Job) -> None:
        """A running job stops at its next step (``cond`` held)."""
        job.cancelled = True
        if job.key not in self.worker_of:
            self.hub.cancel(job.key)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    # -- the loop ---------------------------------------------------------------------------------------
    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.occupancy(len(self.queue), len(self.running))

    def _expire(self) -> None:
        now = time.monotonic()
        for job in [j for j in self.queue if j.deadline is not None and now > j.deadline]:
            self.queue.remove(job)
            job.fail(504, f"the request timed out after {job.timeout:g} s in the queue")
        for key, job in self.running.items():
            if job.deadline is not None and now > job.deadline and job.reason is None and not job.done:
                job.reason = "timeout"
                self._stop(job)                   # the condition's lock is re-entrant

    def _admit(self) -> None:
        while self.queue and len(self.running) < self.max_batch:
            job = self.queue.popleft()
            job.started = time.monotonic()
            self.running[job.key] = job
            key = session_key(self.sampler_cls, job.config)
            if key is None:
                self._start(SoloWorker(self, job))
                continue
            worker = self.sessions.get(key)
            if worker is None or not worker.has_room():
                worker = self.sessions[key] = SessionWorker(self, job.config)
                self._start(worker)
            worker.inbox.append(job)
            self.worker_of[job.key] = worker

    def _start(self, worker) -> None:
        self.hub.register(worker.key)
        threading.Thread(target=worker.run, name=f"setdiff-decode-{worker.key}", daemon=True).start()

    def done(self, job: Job) -> None:
        """A decoding thread finished ``job`` (any thread)."""
        with self.hub.cond:
            self.left.add(job.key)
            self.worker_of.pop(job.key, None)

    def committed(self, n: int) -> None:
        if self.metrics is not None:
            self.metrics.committed(n)

    def _retire(self) -> None:
        for key, worker in list(self.sessions.items()):
            if worker.closed:
                del self.sessions[key]
        for key in list(self.left):
            job = self.running.pop(key, None)
            if job is not None and self.metrics is not None:
                self.metrics.finished(job)
        self.left.clear()

    def _loop(self) -> None:
        cond = self.hub.cond
        while True:
            with cond:
                if self._closing and not self.running:
                    return
                self._expire()
                if not self._closing:
                    self._admit()
                self._gauge()
                if not self.hub.wait_parked(timeout=0.05):
                    continue
                self._retire()
                self._gauge()
                calls = self.hub.take()
                if not calls:
                    if not self.running:
                        cond.wait(timeout=0.05)
                    continue
            self.hub.release(self._step(calls))

    def _step(self, calls: dict) -> dict:
        t0 = time.perf_counter()
        results = {}
        groups: dict = {}
        for key, call in calls.items():
            groups.setdefault(call.cache is not None, []).append(key)
        for keys in groups.values():
            try:
                outs = fused_forward(self.model, [calls[k] for k in keys], self.tokenizer.pad)
                results.update(zip(keys, outs))
            except Exception as e:            # the jobs of this forward fail; the loop goes on
                results.update((k, RuntimeError(f"the decode forward failed: {e}")) for k in keys)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.steps += 1
        if self.metrics is not None:
            self.metrics.step(len(calls), time.perf_counter() - t0)
        return results


__all__ = ["Scheduler", "QueueFull"]
