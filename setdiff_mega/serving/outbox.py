"""Events from the scheduler to the HTTP side, batched per step, and stream chunks coalesced per write.

The scheduler's thread (in the engine process, :mod:`.engine_process`) produces a job's events (``delta``, ``trace``,
``done``, ``error``; :mod:`.job`); each request's handler on the HTTP process's event loop consumes them from its
``asyncio.Queue`` (:mod:`.client` routes them by job key). Handing each event over alone costs a pipe message
(pickling in the decode loop, a wake-up of the event loop) and, for a streaming request, one SSE chunk through
the ASGI server per event. So:

* :class:`Outbox` keeps the events the scheduler's thread emits during a loop iteration and hands them over in
  one ``send(batch)`` at its end (:meth:`Outbox.flush`, the scheduler's ``on_step_end``): one message per step,
  whatever the number of rows; ``batch`` is ``[(key, event, payload)]`` in emission order. More text for a
  stream that has already started waits until ``interval`` seconds have passed since the last hand-over
  (``serve.py --stream-interval``, 0.02 s by default; 0: every step), and at least n / ``rate`` seconds with n
  jobs in flight (``--stream-chunk-rate``, 200 a second by default; 0: no bound): each hand-over costs the HTTP
  side about one SSE chunk per stream (at 8 streams and 0.02 s, 400 chunks a second took 12-21 % of the
  tokens/s on the main job while the HTTP side shared the decode loop's process, docs/results.md "Serving"); a
  stream's first text, its end (``done``, ``error``) and anything after them go at the next flush, so the time
  to first token and to the last are not delayed, and a client sees the same text in fewer, larger chunks.
  Events emitted on any other thread (a refusal or a cancellation handled by the engine's reader thread, the
  shutdown) go over at once.
* :func:`coalesce` merges the text deltas a streaming handler finds waiting for one choice into one delta
  (the concatenation, in order), up to that choice's next other event; the handler writes the chunks it has
  in one piece. The client receives the same text, in at most as many chunks.
"""
from __future__ import annotations

import threading
import time


class Outbox:
    def __init__(self, send, producer, interval: float = 0.0, rate: float = 0.0):
        """``send(batch)``: hands ``[(key, event, payload)]`` over (thread-safe; it may raise OSError when the
        other side is gone: the events are dropped); ``producer()``: whether the calling thread is the
        scheduler's (whose events wait for :meth:`flush`); ``interval``: seconds more text of a started stream
        may wait; ``rate``: the stream chunks a second all jobs in flight together should cost (0: no bound)."""
        self.send, self.producer, self.interval, self.rate = send, producer, float(interval), float(rate)
        self.pending: list = []           # appended and swapped by the scheduler's thread only
        self.urgent = False               # a pending event must go at the next flush
        self.sent = 0.0                   # time of the last hand-over
        self.active = 0                   # jobs that emitted an event but not their end yet
        self._lock = threading.Lock()

    def period(self) -> float:
        """Seconds between hand-overs of more text: ``interval``, or more with many jobs in flight (``rate``)."""
        return max(self.interval, self.active / self.rate) if self.rate > 0 else self.interval

    def emitter(self, key):
        """The ``emit`` of the job ``key``: its events go over as ``(key, event, payload)``."""
        started = counted = ended = False

        def emit(event, payload):                  # a job counts from its first event to its end (a request
            nonlocal started, counted, ended       # refused before it decodes, e.g. 429, never counts)
            end = event in ("done", "error") and not ended
            if not counted or end:
                with self._lock:
                    self.active += (not counted) - end
                counted, ended = True, ended or end
            item = (key, event, payload)
            if self.producer():
                self.urgent = self.urgent or event not in ("delta", "trace") or not started
                started = started or event == "delta"
                self.pending.append(item)
            else:
                self._send([item])
        return emit

    def due(self) -> bool:
        """Whether more text of started streams, emitted now, would go at the next :meth:`flush` (the decodes
        find such text only then: :class:`~.sessions.Decode`)."""
        return time.monotonic() - self.sent >= self.period()

    def flush(self) -> None:
        """Hand over what the scheduler's thread emitted since the last hand-over (one event-loop wake-up),
        unless it is only more text of started streams and ``interval`` has not passed."""
        if not self.pending:
            return
        now = time.monotonic()
        if not self.urgent and now - self.sent < self.period():
            return
        batch, self.pending, self.urgent, self.sent = self.pending, [], False, now
        self._send(batch)

    def _send(self, batch: list) -> None:
        try:
            self.send(batch)
        except (OSError, EOFError):       # the HTTP side is gone (its process ended): nobody reads the events
            pass


def coalesce(events: list) -> list:
    """``events`` [(i, event, payload)] with each run of ``delta`` events of one choice ``i`` (not interrupted by
    another event of ``i``) merged into its first: the order of every choice's events is kept."""
    out, open_delta = [], {}               # i -> index in out of its delta still open for merging
    for i, event, payload in events:
        if event == "delta":
            k = open_delta.get(i)
            if k is not None:
                out[k] = (i, "delta", out[k][2] + payload)
                continue
            open_delta[i] = len(out)
        else:
            open_delta.pop(i, None)
        out.append((i, event, payload))
    return out


__all__ = ["Outbox", "coalesce"]
