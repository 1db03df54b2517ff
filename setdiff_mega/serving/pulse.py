"""The decode loop's vital signs, in memory the engine process and the HTTP process share.

The scheduler's loop (:mod:`.scheduler`) writes, at every turn of its loop (at least every 0.05 s while idle), the
time of that turn (``beat``), the time of its last decode step (``step``), its occupancy and its state; the HTTP
side (:mod:`.client`) reads them without a message to the engine, so /health answers at once and truthfully even
when the engine process is frozen (a C call holding the GIL, a stopped process) or its loop thread is dead, and
its watchdog sees a stall as a beat that grows old. Times are ``time.monotonic()`` (one clock for both processes
on a host). Each field is one aligned double: a reader sees each field whole.
"""
from __future__ import annotations

import time

FIELDS = ("beat", "step", "running", "queued", "state")
STATES = ("starting", "running", "died", "closed")
STARTING, RUNNING, DIED, CLOSED = range(4)


class Pulse:
    def __init__(self, array=None):
        """``array``: a ``multiprocessing`` RawArray('d', len(FIELDS)) shared with the other process (None: a
        list of this process's own, for a scheduler run in-process)."""
        self.a = array if array is not None else [0.0] * len(FIELDS)

    @classmethod
    def shared(cls, ctx) -> "Pulse":
        return cls(ctx.RawArray("d", len(FIELDS)))

    # -- the loop's side ---------------------------------------------------------------------------------------
    def beat(self, running: int, queued: int) -> None:
        self.a[2], self.a[3] = float(running), float(queued)
        self.a[0] = time.monotonic()

    def stepped(self) -> None:
        self.a[1] = time.monotonic()

    def set_state(self, state: int) -> None:
        if state == RUNNING:
            self.a[0] = time.monotonic()
        self.a[4] = float(state)

    # -- the reader's side -------------------------------------------------------------------------------------
    @property
    def state(self) -> int:
        return int(self.a[4])

    def age(self) -> float | None:
        """Seconds since the loop's last turn (None before its first)."""
        beat = self.a[0]
        return time.monotonic() - beat if beat else None

    def read(self) -> dict:
        """/health's view: loop state, its last turn's and last step's ages (s), running and queued jobs."""
        now = time.monotonic()
        beat, step, running, queued, state = list(self.a)
        return {"loop": STATES[int(state)] if 0 <= int(state) < len(STATES) else "unknown",
                "loop_alive": int(state) == RUNNING,
                "last_beat_age_s": round(now - beat, 3) if beat else None,
                "last_step_age_s": round(now - step, 3) if step else None,
                "running": int(running), "queued": int(queued)}


__all__ = ["Pulse", "STARTING", "RUNNING", "DIED", "CLOSED"]
