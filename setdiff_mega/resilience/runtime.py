"""What the trainer holds for fault tolerance (:class:`FaultTolerance`): the rank's heartbeat and its
watchdog (:mod:`.heartbeat`), the blocking collectives it is inside (:mod:`.collectives`), the straggler
statistics (:mod:`.straggler`), the injected faults of a chaos run (:mod:`.chaos`) and the restart count
the supervisor passes down (``SETDIFF_RESTART_COUNT``, logged as ``fault/restarts``). The trainer wraps
each unit of work::

    with ft.step(step):            ... one optimizer step     (heartbeat "train step N", straggler timing)
    with ft.phase("validate", n):  ... a validation
    with ft.phase("save", n):      ... a checkpoint save;  ft.saved(n) once it is scheduled
    ft.metrics()                   every log interval, on every rank (a collective)
"""
from __future__ import annotations

import contextlib
import os
import time

from .chaos import Chaos
from .collectives import tracked, tracked_method
from .heartbeat import start
from .straggler import StragglerMonitor


class FaultTolerance:
    def __init__(self, fc, rank: int, run_dir, warn=print):
        self.heart = start(fc, rank, run_dir)
        self._open = contextlib.ExitStack()
        if fc.watchdog:
            self._open.enter_context(tracked(self.heart))
        self.straggler = StragglerMonitor(fc.straggler_factor, fc.straggler_patience, warn)
        self.chaos = Chaos.from_env(rank)
        self.restarts = int(os.environ.get("SETDIFF_RESTART_COUNT", "0") or 0)
        self.reducer = None

    def attach(self, reducer) -> None:
        """The data-parallel gradient reducer (or None): its ``finish`` is where a fast rank waits for the
        others (a collective for the watchdog; its ``waited`` seconds for the straggler report)."""
        if reducer is not None and hasattr(reducer, "finish"):
            self.reducer = reducer
            reducer.finish = tracked_method(self.heart, reducer.finish, "gradient all-reduce")

    def first_step(self, start_step: int, resumed) -> int | None:
        """The step after which a run's earlier metrics are dropped: the resumed step, or, for a restart that
        found no checkpoint, every row (they belong to this job's failed attempt); None keeps them all."""
        if resumed is not None:
            return start_step
        return -1 if self.restarts > 0 else None

    def _waited(self) -> float:
        return getattr(self.reducer, "waited", 0.0)

    @contextlib.contextmanager
    def step(self, step: int):
        """0-based ``step``: the heartbeat names it ``train step step+1`` (the step the logs will report)."""
        with self.heart.phase("step", step + 1, f"train step {step + 1}"):
            t0, w0 = time.perf_counter(), self._waited()
            if self.chaos is not None:
                self.chaos.before_step(step)
            yield
            self.straggler.record(time.perf_counter() - t0, self._waited() - w0)

    def phase(self, kind: str, step: int, what: str | None = None):
        return self.heart.phase(kind, step, what or f"{kind} at step {step}")

    def saved(self, step: int) -> None:
        if self.chaos is not None:
            self.chaos.after_save(step)

    def metrics(self) -> dict:
        return {**self.straggler.report(), "fault/restarts": self.restarts}

    def close(self, clean: bool = True) -> None:
        self._open.close()
        self.heart.close(clean)


__all__ = ["FaultTolerance"]
