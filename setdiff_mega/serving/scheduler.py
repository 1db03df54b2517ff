"""The scheduler: one loop owns the model and runs every running request's next decode step as one forward.

    loop:
        expire     queued jobs past their deadline fail (504); running ones are cancelled
        admit      queued jobs join while running < max_batch: each gets a thread running its objective's own
                   sampler against the :class:`~.fusion.BatchedModel` (its first call: the prefill)
        wait       until every running job's thread is parked in a model call or has finished
        retire     finished jobs leave the batch (EOS, stop string, max_tokens, cancellation, error)
        step       the parked calls -> :func:`~.fusion.fused_forward` (cached and uncached calls apart) -> each
                   thread gets its logits and runs its sampler's bookkeeping up to its next call

A job's KV cache is its own (capacity: the context budget L; ``max_batch`` of them at most), so joining and
leaving never copy another's. The queue is bounded (``max_queue``: :class:`QueueFull`, HTTP 429). Client
disconnects and timeouts cancel a job: its thread raises :class:`~.fusion.Cancelled` at its next model call
and leaves the batch before the next step. A failing forward fails the jobs in it (HTTP 500), not the loop.
"""
from __future__ import annotations

import collections
import threading
import time

import torch

from setdiff_mega.decoding.base import Canvas
from setdiff_mega.decoding.context import ContextOverflow
from setdiff_mega.errors import RequestError
from setdiff_mega.inference.api import build_sampler

from .fusion import BatchedModel, Cancelled, StepHub, fused_forward
from .job import Job


class QueueFull(Exception):
    """The waiting queue is full (HTTP 429)."""


class Scheduler:
    def __init__(self, model, tokenizer, method, *, max_batch: int = 8, max_queue: int = 256, metrics=None):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_queue ({max_queue}) must be >= 1")
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.max_batch, self.max_queue, self.metrics = max_batch, max_queue, metrics
        self.hub = StepHub()
        self.proxy = BatchedModel(model, self.hub)
        self.device = next(model.parameters()).device
        self.queue: collections.deque = collections.deque()
        self.running: dict[int, Job] = {}
        self.left: set = set()           # keys whose thread has finished
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
            for key in list(self.running):
                self.hub.cancel(key)
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
                self.hub.cancel(key)              # the condition's lock is re-entrant

    def _admit(self) -> None:
        while self.queue and len(self.running) < self.max_batch:
            job = self.queue.popleft()
            job.started = time.monotonic()
            self.running[job.key] = job
            self.hub.register(job.key)
            threading.Thread(target=self._decode, args=(job,), name=f"setdiff-job-{job.key}", daemon=True).start()

    def _retire(self) -> None:
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
            self.metrics.step(len(calls), self.max_batch, time.perf_counter() - t0)
        return results

    # -- a job's thread ---------------------------------------------------------------------------------
    def _observer(self, job: Job):
        def observe(st):
            if job.observe(st):
                raise Cancelled()             # a stop string ended the text
            if self.metrics is not None:
                self.metrics.committed(job.committed_last)
        return observe

    def _decode(self, job: Job) -> None:
        self.hub.bind(job.key)
        try:
            sampler = build_sampler(self.method, self.proxy, self.tokenizer, job.config)
            sampler.observer = self._observer(job)
            canvas = Canvas.from_prompts([job.ids], self.tokenizer.mask, self.tokenizer.pad,
                                         job.config.max_new_tokens, device=self.device)
            out = sampler.generate(canvas)
            job.finish(out)
        except Cancelled:
            job.finish(None)
        except (RequestError, ContextOverflow, ValueError) as e:
            job.fail(400, str(e))
        except Exception as e:                # noqa: BLE001 (one request's failure is reported, never raised)
            job.fail(500, f"decoding failed: {type(e).__name__}: {e}")
        finally:
            with self.hub.cond:
                self.left.add(job.key)
            self.hub.leave()


__all__ = ["Scheduler", "QueueFull"]
