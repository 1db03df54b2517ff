"""The HTTP side's watchdog over the engine process: a failed engine's requests fail, the engine is restarted or
the server gives up.

A watchdog task on the event loop looks every :data:`WATCH_PERIOD` seconds at the engine process and at the loop's
:class:`~.pulse.Pulse` (shared memory): the process gone, the loop dead (:mod:`.supervision`), or the loop not
turning for ``stall_timeout`` seconds (a stall: a step that never ends, a frozen process) is a failure: every job
in flight ends with a 503 error event naming it (one line), /health answers 503 (at once:
:meth:`~.client.EngineClient.health` reads the pulse itself), the engine process is killed and a new one started (a
log line each), up to ``restarts`` times within ``restart_window`` seconds; beyond that (or with ``restarts`` 0, or
when the new engine cannot load) ``fatal`` is set and ``on_fatal(reason)`` called: the server stops and exits with
status 3 (:mod:`setdiff_mega.serve`), for a process manager to restart it.

:class:`Watchdog` is a part of :class:`~.client.EngineClient` (a mixin): it uses the client's ``proc``, ``conn``,
``pulse``, ``outgoing``, ``closing``, ``lost``, ``died``, ``down``, ``fatal``, ``on_fatal``, ``stall_timeout``,
``max_restarts``, ``restart_window``, ``restarts``, ``_restarted``, and its ``_spawn``, ``_attach_reader``,
``_detach`` and ``_fail_routes``.
"""
from __future__ import annotations

import asyncio
import sys
import time

from .pulse import DIED, RUNNING

WATCH_PERIOD = 0.2              # seconds between the watchdog's looks at the engine


class Watchdog:
    def _failure(self) -> str | None:
        """What is wrong with the engine now (None: nothing): its process gone, its loop dead or stalled."""
        if self.proc is None:
            return None
        if self.lost is not None:
            return self.lost
        if not self.proc.is_alive():
            return f"the decoding engine exited (status {self.proc.exitcode})"
        state = self.pulse.state
        if state == DIED:
            return self.died or "the decode loop died (its messages are in the server's log)"
        age = self.pulse.age()
        if state == RUNNING and self.stall_timeout and age is not None and age > self.stall_timeout:
            return (f"the decode loop stalled: no turn for {age:.1f} s (--stall-timeout {self.stall_timeout:g}; "
                    f"its step never ended or its process froze)")
        return None

    async def _watch(self) -> None:
        """The watchdog (module docstring): every WATCH_PERIOD seconds, a failure found is recovered from."""
        while not self.closing and self.fatal is None:
            await asyncio.sleep(WATCH_PERIOD)
            if self.down is None and not self.closing:
                reason = self._failure()
                if reason is not None:
                    await self._recover(reason)

    def _kill(self) -> None:
        """The current engine process ends (killed when it still runs: it may be frozen), its pipe closed."""
        self._detach()
        self.outgoing.put(None)
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(timeout=10)
        if self.conn is not None and not self.conn.closed:
            self.conn.close()

    def _give_up(self, reason: str) -> None:
        self.fatal = reason
        print(f"error: {reason}; the server exits with status 3 for its process manager to restart it",
              file=sys.stderr, flush=True)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    async def _recover(self, reason: str) -> None:
        """A failed engine: its jobs fail (503, one line), it is killed, a new one is started (or the server
        gives up: module docstring)."""
        self.down = reason
        self._fail_routes(503, f"{reason}; retry the request")
        self._kill()
        now = time.monotonic()
        while self._restarted and now - self._restarted[0] > self.restart_window:
            self._restarted.popleft()
        if len(self._restarted) >= self.max_restarts:
            self._give_up(f"{reason}; no engine restart left ({len(self._restarted)} in the last "
                          f"{self.restart_window:g} s, --engine-restarts {self.max_restarts})")
            return
        self._restarted.append(now)
        self.restarts += 1
        print(f"warning: {reason}; restarting the decoding engine (restart {self.restarts}, "
              f"{len(self._restarted)} of {self.max_restarts} within {self.restart_window:g} s)",
              file=sys.stderr, flush=True)
        self.down = f"{reason}; the decoding engine is restarting, retry in a few seconds"
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._spawn)
        except Exception as e:                   # noqa: BLE001 (the model cannot be loaded again: give up)
            if not self.closing:                 # (a shutdown meanwhile stops the start: no failure of its own)
                self._give_up(f"{reason}; the engine could not be restarted ({type(e).__name__}: {e})")
            return
        if self.closing:
            self._kill()
            return
        self._attach_reader()
        self.down = None
        print(f"the decoding engine is back (restart {self.restarts}, pid {self.proc.pid})", file=sys.stderr,
              flush=True)


__all__ = ["Watchdog", "WATCH_PERIOD"]
