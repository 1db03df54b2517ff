"""The HTTP side's handle on the engine process (:mod:`.engine`): start it, queue jobs, route their events.

    EngineClient(args).start()  -> info    spawn the engine, wait for ``ready`` (its ``fatal`` raised here)
    client.attach(loop)                    read the engine's pipe on this event loop (``add_reader``: no thread)
    client.submit(specs, queue)  -> [Ticket]   queue jobs; job i's events arrive in ``queue`` as (i, event,
                                           payload); QueueFull (HTTP 429) when the queue would exceed its bound,
                                           EngineGone (503) when the engine is not running
    client.cancel(ticket, reason)          stop a job that has not ended
    await client.ask("health" | "metrics") the engine's answer (its reader thread answers between steps)
    client.close()                         ``close`` the engine, wait for it (then kill it), idempotent

Messages to the engine go through a sender thread (its queue unbounded): the event loop never blocks on a full
pipe, so it always reads the engine's events, and the two processes cannot wait on each other's writes.

The queue bound is kept here, so a refusal is known before a response starts (a stream's status is sent
first): with ``inflight`` jobs submitted and not ended (their end event read), the engine runs min(inflight,
max_batch) of them and queues the rest, so a request of n jobs is refused when inflight + n - max_batch >
max_queue. (A job that ended in the engine but whose end is not read yet still counts: the bound is never
looser than the engine's queue.) If the engine dies, every job in flight ends with a 500 error event naming it,
/health answers 503 and new requests 503.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing
import queue as queues
import threading

from .scheduler import QueueFull

READ_BATCH = 64                 # messages read per wake-up of the event loop (others wait for the next)


class EngineGone(RuntimeError):
    """The engine process is not running (HTTP 503)."""


class Ticket:
    """A submitted job as the HTTP side knows it: its key and whether its end was read."""
    __slots__ = ("key", "done")

    def __init__(self, key: int):
        self.key, self.done = key, False


class EngineClient:
    def __init__(self, args, max_batch: int, max_queue: int):
        self.args, self.max_batch, self.max_queue = args, max_batch, max_queue
        self.proc = self.conn = self.loop = None
        self.routes: dict = {}            # key -> (queue, index, ticket) until the job's end is read
        self.asks: dict = {}              # ask id -> Future
        self._keys, self._ask_ids = itertools.count(), itertools.count()
        self.closing = False
        self.lost: str | None = None      # why the engine is gone (set once its pipe ended unexpectedly)
        self.outgoing: queues.SimpleQueue = queues.SimpleQueue()      # messages for the sender thread (None: stop)
        self._sender: threading.Thread | None = None

    # -- life -------------------------------------------------------------------------------------------------
    def start(self) -> dict:
        """Spawn the engine and wait until it loaded the model: its ``ready`` info."""
        from .engine import main

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=main, args=(child, self.args), name="setdiff-engine", daemon=False)
        self.proc.start()
        child.close()
        atexit.register(self.close)       # before multiprocessing's own exit hook joins the child
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                break
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise RuntimeError(f"the decoding engine exited with status {self.proc.exitcode} while loading "
                               f"the model (its messages are above)") from None
        if message[0] == "fatal":
            self.proc.join(timeout=10)
            raise (ValueError if message[1] else RuntimeError)(message[2])
        self._sender = threading.Thread(target=self._send_loop, name="setdiff-engine-sender", daemon=True)
        self._sender.start()
        return message[1]

    def _send_loop(self) -> None:
        while (message := self.outgoing.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, EOFError):           # the engine is gone: the reader sees its end of file
                try:
                    self.loop.call_soon_threadsafe(self._lost)
                except (AttributeError, RuntimeError):    # no loop yet, or it is closed
                    pass
                return

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.lost is None and not self.closing

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine (queued jobs fail, running ones are cancelled) and wait for it; kill it after
        ``timeout`` seconds."""
        if self.proc is None or self.closing:
            return
        self.closing = True
        self._detach()
        if self._sender is not None:
            self.outgoing.put(("close",))
            self.outgoing.put(None)
            self._sender.join(timeout=timeout)
        else:                                     # interrupted while loading: the pipe's end stops the engine
            self.conn.close()
        self.proc.join(timeout=timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        if not self.conn.closed:
            self.conn.close()

    # -- requests -------------------------------------------------------------------------------------------
    def attach(self, loop) -> None:
        """Read the engine's messages on ``loop`` (the HTTP server's event loop)."""
        if self.loop is loop:
            return
        self.loop = loop
        loop.add_reader(self.conn.fileno(), self._readable)

    def _send(self, message) -> None:
        self.outgoing.put(message)

    def submit(self, specs: list, queue) -> list:
        """Queue ``specs`` (:class:`~.engine.JobSpec` without keys: given here), all or none; spec i's events go
        to ``queue`` as (i, event, payload)."""
        if not self.alive:
            raise EngineGone(self.lost or "the server is shutting down")
        inflight = len(self.routes)
        if inflight + len(specs) - self.max_batch > self.max_queue:
            raise QueueFull(f"the queue is full ({max(0, inflight - self.max_batch)} waiting, limit "
                            f"{self.max_queue}); retry later")
        tickets = []
        for i, spec in enumerate(specs):
            spec.key = next(self._keys)
            ticket = Ticket(spec.key)
            self.routes[spec.key] = (queue, i, ticket)
            tickets.append(ticket)
        self._send(("submit", specs))
        return tickets

    def cancel(self, ticket: Ticket, reason: str = "cancelled") -> None:
        if not ticket.done and self.alive:
            self._send(("cancel", ticket.key, reason))

    async def ask(self, what: str, timeout: float = 30.0):
        """The engine's answer to ``what`` (``health``, ``metrics``)."""
        if not self.alive:
            raise EngineGone(self.lost or "the server is shutting down")
        i = next(self._ask_ids)
        future = self.asks[i] = asyncio.get_running_loop().create_future()
        try:
            self._send(("ask", i, what))
            return await asyncio.wait_for(future, timeout)
        finally:
            self.asks.pop(i, None)

    # -- the engine's messages ------------------------------------------------------------------------------
    def _detach(self) -> None:
        """Stop reading the pipe on the event loop (if it is attached and still open)."""
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.remove_reader(self.conn.fileno())
            except (ValueError, OSError, RuntimeError):
                pass

    def _readable(self) -> None:
        try:
            for _ in range(READ_BATCH):
                if not self.conn.poll():
                    return
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            self._lost()

    def _dispatch(self, message) -> None:
        if message[0] == "events":
            for key, event, payload in message[1]:
                route = self.routes.get(key)
                if route is None:
                    continue
                queue, i, ticket = route
                if event in ("done", "error"):
                    ticket.done = True
                    del self.routes[key]
                queue.put_nowait((i, event, payload))
        elif message[0] == "answer":
            future = self.asks.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])

    def _lost(self) -> None:
        """The engine's pipe ended: every job in flight fails, every question fails."""
        if self.lost is not None or self.closing:
            return
        self._detach()
        self.proc.join(timeout=0.5)                  # its exit status, when it has one already
        self.lost = (f"the decoding engine exited (status {self.proc.exitcode}); its messages are in the server's "
                     f"log; restart the server")
        for queue, i, ticket in self.routes.values():
            ticket.done = True
            queue.put_nowait((i, "error", (500, self.lost)))
        self.routes.clear()
        for future in self.asks.values():
            if not future.done():
                future.set_exception(EngineGone(self.lost))


__all__ = ["EngineClient", "EngineGone", "Ticket"]
