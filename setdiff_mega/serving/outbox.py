"""Events from the scheduler to the HTTP side, batched per step, and stream chunks coalesced per write.

The scheduler's thread produces a job's events (``delta``, ``trace``, ``done``, ``error``; :mod:`.job`); each
request's handler on the event loop consumes them from its ``asyncio.Queue``. Handing each event over alone
costs a wake-up of the event loop (``call_soon_threadsafe`` writes to its self-pipe) and, for a streaming
request, one SSE chunk through the ASGI server per event, all while holding the GIL the scheduler's thread
needs for its next step. So:

* :class:`Outbox` keeps the events the scheduler's thread emits during a loop iteration and hands them over in
  one call at its end (:meth:`Outbox.flush`, the scheduler's ``on_step_end``): one wake-up per step, whatever
  the number of rows. More text for a stream that has already started waits until ``interval`` seconds have
  passed since the last hand-over (``serve.py --stream-interval``, 0.02 s by default; 0: every step), and
  at least n / ``rate`` seconds with n requests' jobs in flight (``--stream-chunk-rate``, 200 a second by
  default; 0: no bound): each hand-over costs the HTTP side about one SSE chunk per stream, Python work that
  shares the GIL with the decode loop (at 8 streams and 0.02 s, 400 chunks a second took 12-21 % of the
  tokens/s on the main job, docs/results.md "Serving"); a stream's first text, its end (``done``, ``error``)
  and anything after them go at the next flush, so the time to first token and to the last are not delayed,
  and a client sees the same text in fewer, larger chunks. Events emitted on any other thread (a cancellation
  or a failure on the HTTP side, the shutdown) go over at once.
* :func:`coalesce` merges the text deltas a streaming handler finds waiting for one choice into one delta
  (the concatenation, in order), up to that choice's next other event; the handler writes the chunks it has
  in one piece. The client receives the same text, in at most as many chunks.
"""
from __future__ import annotations

import threading
import time


def _deliver(batch: list) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class Outbox:
    def __init__(self, loop, producer, interval: float = 0.0, rate: float = 0.0):
        """``loop``: the event loop of the queues; ``producer()``: whether the calling thread is the scheduler's
        (whose events wait for :meth:`flush`); ``interval``: seconds more text of a started stream may wait;
        ``rate``: the stream chunks a second all jobs in flight together should cost (0: no bound)."""
        self.loop, self.producer, self.interval, self.rate = loop, producer, float(interval), float(rate)
        self.pending: list = []           # appended and swapped by the scheduler's thread only
        self.urgent = False               # a pending event must go at the next flush
        self.sent = 0.0                   # time of the last hand-over
        self.active = 0                   # jobs that emitted an event but not their end yet
        self._lock = threading.Lock()

    def period(self) -> float:
        """Seconds between hand-overs of more text: ``interval``, or more with many jobs in flight (``rate``)."""
        return max(self.interval, self.active / self.rate) if self.rate > 0 else self.interval

    def emitter(self, queue, i: int):
        """The ``emit`` of a request's job ``i``: its events go to ``queue`` as ``(i, event, payload)``."""
        started = counted = ended = False

        def emit(event, payload):                  # a job counts from its first event to its end (a request
            nonlocal started, counted, ended       # refused before it decodes, e.g. 429, never counts)
            end = event in ("done", "error") and not ended
            if not counted or end:
                with self._lock:
                    self.active += (not counted) - end
                counted, ended = True, ended or end
            item = (i, event, payload)
            if self.producer():
                self.urgent = self.urgent or event not in ("delta", "trace") or not started
                started = started or event == "delta"
                self.pending.append((queue, item))
            else:
                self._send([(queue, item)])
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
            self.loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:              # the event loop is gone (server shutting down)
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
