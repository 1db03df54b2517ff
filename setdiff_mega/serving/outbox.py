"""Events from the scheduler to the HTTP side, batched per step, and stream chunks coalesced per write.

The scheduler's thread produces a job's events (``delta``, ``trace``, ``done``, ``error``; :mod:`.job`); each
request's handler on the event loop consumes them from its ``asyncio.Queue``. Handing each event over alone
costs a wake-up of the event loop (``call_soon_threadsafe`` writes to its self-pipe) and, for a streaming
request, one SSE chunk through the ASGI server per event, all while holding the GIL the scheduler's thread
needs for its next step. So:

* :class:`Outbox` keeps the events the scheduler's thread emits during a loop iteration and hands them over in
  one call at its end (:meth:`Outbox.flush`, the scheduler's ``on_step_end``): one wake-up per step, whatever
  the number of rows. Events emitted on any other thread (a cancellation or a failure on the HTTP side, the
  shutdown) go over at once, as before.
* :func:`coalesce` merges the text deltas a streaming handler finds waiting for one choice into one delta
  (the concatenation, in order), up to that choice's next other event; the handler writes the chunks it has
  in one piece. The client receives the same text, in at most as many chunks.
"""
from __future__ import annotations


def _deliver(batch: list) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class Outbox:
    def __init__(self, loop, producer):
        """``loop``: the event loop of the queues; ``producer()``: whether the calling thread is the scheduler's
        (whose events wait for :meth:`flush`)."""
        self.loop, self.producer = loop, producer
        self.pending: list = []           # appended and swapped by the scheduler's thread only

    def emitter(self, queue, i: int):
        """The ``emit`` of a request's job ``i``: its events go to ``queue`` as ``(i, event, payload)``."""
        def emit(event, payload):
            item = (i, event, payload)
            if self.producer():
                self.pending.append((queue, item))
            else:
                self._send([(queue, item)])
        return emit

    def flush(self) -> None:
        """Hand over what the scheduler's thread emitted since the last flush (one event-loop wake-up)."""
        if self.pending:
            batch, self.pending = self.pending, []
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
