"""The server's Prometheus metrics (``GET /metrics``, text format), in registries of their own (no global state):
the HTTP process's (:class:`HttpMetrics`) and the engine process's (:class:`Metrics`, rendered there and fetched
over the engine's pipe for each scrape); /metrics is the two texts one after the other (no name in both).

    setdiff_requests_total{endpoint, status}        HTTP requests answered (the HTTP process)
    setdiff_loop_alive                              1 while the decode loop runs and is not stalled, else 0
    setdiff_loop_beat_age_seconds                   seconds since the decode loop's last turn (:mod:`.pulse`)
    setdiff_last_step_age_seconds                   seconds since its last decode step (-1 before the first)
    setdiff_engine_restarts                         engine restarts by the watchdog so far (:mod:`.client`)
    setdiff_queue_length                            jobs waiting for a batch slot
    setdiff_running                                 jobs in the batch (occupancy = running / max_batch)
    setdiff_batch_rows                              histogram: jobs fused into one forward (a decode step)
    setdiff_step_seconds                            histogram: wall time of a decode step (all fused forwards)
    setdiff_decode_steps_total                      decode steps
    setdiff_step_part_seconds_total{part}           decode-step time by part: admit, calls, fuse, forward,
                                                    advance (scheduler.PARTS; all but forward: host time)
    setdiff_generated_tokens_total                  tokens committed by decode steps
    setdiff_tokens_per_step                         histogram: tokens one job committed in one step
    setdiff_tokens_per_second                       tokens committed over the last ``window`` seconds / window
    setdiff_time_to_first_token_seconds             histogram: arrival -> first text emitted
    setdiff_request_latency_seconds                 histogram: arrival -> finished
    setdiff_jobs_total{reason}                      finished jobs by reason (stop, length, cancelled, timeout)
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class HttpMetrics:
    """What the HTTP process counts: the requests it answered."""
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("setdiff_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.alive = Gauge("setdiff_loop_alive", "1 while the decode loop runs and is not stalled", registry=r)
        self.beat_age = Gauge("setdiff_loop_beat_age_seconds", "seconds since the decode loop's last turn",
                              registry=r)
        self.step_age = Gauge("setdiff_last_step_age_seconds", "seconds since the last decode step (-1: none yet)",
                              registry=r)
        self.restarts = Gauge("setdiff_engine_restarts", "engine restarts by the watchdog", registry=r)

    def watch(self, engine) -> None:
        """The loop's vital signs, read from ``engine`` (an :class:`~.client.EngineClient`) at each scrape."""
        def read(field, default=-1.0):
            def value():
                v = engine.health().get(field)
                return default if v is None else float(v)
            return value
        self.alive.set_function(lambda: float(engine.health()["status"] == "ok"))
        self.beat_age.set_function(read("last_beat_age_s"))
        self.step_age.set_function(read("last_step_age_s"))
        self.restarts.set_function(lambda: float(engine.restarts))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Metrics:
    """What the engine counts: occupancy, decode steps and their parts, tokens, finished jobs."""

    def __init__(self, window: float = 10.0):
        r = self.registry = CollectorRegistry()
        self.queue = Gauge("setdiff_queue_length", "jobs waiting for a batch slot", registry=r)
        self.running = Gauge("setdiff_running", "jobs in the running batch", registry=r)
        self.rows = Histogram("setdiff_batch_rows", "jobs fused into one decode step",
                              buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.step_s = Histogram("setdiff_step_seconds", "wall time of one decode step", buckets=LATENCY, registry=r)
        self.steps = Counter("setdiff_decode_steps", "decode steps (one fused forward each)", registry=r)
        self.parts = Counter("setdiff_step_part_seconds", "decode-step time by part (forward: the model; the rest "
                             "is host time)", ["part"], registry=r)
        self.tokens = Counter("setdiff_generated_tokens", "tokens committed by decode steps", registry=r)
        self.per_step = Histogram("setdiff_tokens_per_step", "tokens one job committed in one step",
                                  buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32), registry=r)
        self.tps = Gauge("setdiff_tokens_per_second", "tokens committed per second (recent window)", registry=r)
        self.ttft = Histogram("setdiff_time_to_first_token_seconds", "arrival to first text", buckets=LATENCY,
                              registry=r)
        self.latency = Histogram("setdiff_request_latency_seconds", "arrival to finished", buckets=LATENCY,
                                 registry=r)
        self.jobs = Counter("setdiff_jobs", "finished jobs by reason", ["reason"], registry=r)
        self.window = window
        self._recent: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.tps.set_function(self._rate)

    def _prune(self, now: float) -> None:
        """Forget commits older than the window (``_lock`` held): the window's list stays bounded whether or not
        anyone scrapes."""
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()

    def _rate(self) -> float:
        with self._lock:
            self._prune(time.monotonic())
            return sum(n for _, n in self._recent) / self.window

    def occupancy(self, queued: int, running: int) -> None:
        self.queue.set(queued)
        self.running.set(running)

    def step(self, rows: int, seconds: float, parts: dict | None = None) -> None:
        self.rows.observe(rows)
        self.step_s.observe(seconds)
        self.steps.inc()
        for k, v in (parts or {}).items():
            self.part(k, v)

    def part(self, name: str, seconds: float) -> None:
        """Time of one part of a step (also one measured after the step was recorded: its events' hand-over)."""
        self.parts.labels(part=name).inc(seconds)

    def committed(self, counts: list[int]) -> None:
        """One decode step's committed tokens, per busy row."""
        n = sum(counts)
        if n:
            self.tokens.inc(n)
            now = time.monotonic()
            with self._lock:
                self._recent.append((now, n))
                self._prune(now)
        for c in counts:
            self.per_step.observe(c)

    def finished(self, job) -> None:
        self.jobs.labels(reason=job.reason or "error").inc()
        if job.first_token is not None:
            self.ttft.observe(job.first_token - job.arrival)
        if job.finished is not None:
            self.latency.observe(job.finished - job.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["Metrics", "HttpMetrics"]
