"""The decode loop's supervision, in the engine process: the loop runs with its state in its
:class:`~.pulse.Pulse`, and its death (an error no per-decode guard caught: a bug of the loop itself) is reported.

The scheduler guards every part of a step that runs a decode's or a client's code per decode (its jobs fail, the
loop goes on: :mod:`.scheduler`, :mod:`.forwards`). Anything else that escapes ends the loop: one line to stderr
(the traceback after it), every job in flight fails with it (500), the pulse's state is ``died`` and
``on_death(message)`` is called; the HTTP side's watchdog (:mod:`.watchdog`) then restarts the engine or the server
exits. A test may inject a fault (``die``, ``stall``) the loop acts on at its next turn.

:class:`Supervised` is a part of :class:`~.scheduler.Scheduler` (a mixin): it uses the scheduler's ``pulse``,
``cond``, ``queue``, ``running``, ``error``, ``on_death``, ``fault``, ``_closing``, ``_loop`` and ``_end_step``.
"""
from __future__ import annotations

import sys
import time
import traceback

from .pulse import CLOSED, DIED, RUNNING


class Supervised:
    def _run(self) -> None:
        """The loop, supervised (module docstring): its state in the pulse, its death reported."""
        self.pulse.set_state(RUNNING)
        try:
            self._loop()
        except BaseException as e:            # noqa: BLE001 (the loop's own bug: reported, its jobs failed)
            self._died(e)
            return
        self.pulse.set_state(CLOSED)

    def _died(self, e: BaseException) -> None:
        """The loop ends on an error: one line to stderr (the traceback after it), every job in flight fails with
        it (500), the pulse says ``died``, ``on_death`` hears it."""
        message = " ".join(f"the decode loop died: {type(e).__name__}: {e}".split())[:300]
        self.error = message
        print(f"error: {message}", file=sys.stderr, flush=True)
        traceback.print_exc(file=sys.stderr)
        with self.cond:
            jobs = [*self.queue, *self.running.values()]
            self.queue.clear()
            self.running.clear()
        for job in jobs:
            if not job.done:
                try:
                    job.fail(500, f"{message}; the engine is being restarted, retry the request")
                except Exception:             # noqa: BLE001
                    pass
        try:
            self._end_step()
        except Exception:                     # noqa: BLE001 (the events could not go: the watchdog fails them)
            pass
        self.pulse.set_state(DIED)
        if self.on_death is not None:
            try:
                self.on_death(message)
            except Exception:                 # noqa: BLE001
                pass

    def _inject(self) -> None:
        """A fault a test injected (the engine's ``fault`` message, honoured only when the server was built to
        allow it): ``die``, an error no guard catches; ``stall``, the loop stops turning."""
        kind, self.fault = self.fault, None
        if kind == "die":
            raise RuntimeError("a fault injected by a test")
        if kind == "stall":
            while not self._closing:
                time.sleep(0.05)


__all__ = ["Supervised"]
