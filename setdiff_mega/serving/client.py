"""The HTTP side's handle on the engine process (:mod:`.engine_process`): start it, queue jobs, route their events.

    EngineClient(args).start()  -> info    spawn the engine, wait for ``Ready`` (its ``Fatal`` raised here)
    client.attach(loop)                    read the engine's pipe on this event loop (``add_reader``: no thread)
    client.submit(specs, queue, who) -> [Ticket]   queue jobs; job i's events arrive in ``queue`` as (i, event,
                                           payload); NeverFits (HTTP 400) when the request alone is over a
                                           client's bound, QueueFull (429) when the queue or the client's share
                                           would exceed its bound, EngineGone (503) when the engine is not running
    client.cancel(ticket, reason)          stop a job that has not ended
    client.health()                        /health's answer, from the loop's pulse (no message to the engine)
    await client.ask("metrics")            the engine's answer (its reader thread answers between steps)
    client.close()                         ``close`` the engine, wait for it (then kill it), idempotent

Messages (typed: :mod:`.messages`) to the engine go through a sender thread (its queue unbounded): the event loop
never blocks on a full pipe, so it always reads the engine's events, and the two processes cannot wait on each
other's writes.

The queue bound is kept here, so a refusal is known before a response starts (a stream's status is sent
first): with ``inflight`` jobs submitted and not ended (their end event read), the engine runs min(inflight,
max_batch) of them and queues the rest, so a request of n jobs is refused when inflight + n - max_batch >
max_queue. (A job that ended in the engine but whose end is not read yet still counts: the bound is never
looser than the engine's queue.) Each client (:func:`~.bounded.client_id`) may have at most ``max_client_jobs``
in flight (by default half of max_batch + max_queue, so one client's flood leaves room for the others; the
engine takes queued jobs round-robin by client); a request of more jobs than that can never be admitted and is
refused at once (:class:`NeverFits`, HTTP 400 with the limit).

Supervision (:mod:`.watchdog`): a dead or stalled engine's requests fail (503, one line), the engine is restarted
up to ``restarts`` times within ``restart_window`` seconds, beyond that the server exits with status 3.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import multiprocessing
import queue as queues
import threading

from .messages import Answer, Ask, Cancel, Close, Died, EngineGone, Events, Fatal, Fault, NeverFits, QueueFull, Submit
from .pulse import Pulse
from .watchdog import Watchdog

READ_BATCH = 64                 # messages read per wake-up of the event loop (others wait for the next)


class Ticket:
    """A submitted job as the HTTP side knows it: its key, its client and whether its end was read."""
    __slots__ = ("key", "done", "client")

    def __init__(self, key: int, client: str = ""):
        self.key, self.done, self.client = key, False, client


class EngineClient(Watchdog):
    def __init__(self, args, max_batch: int, max_queue: int, max_client_jobs: int | None = None,
                 stall_timeout: float | None = None, restarts: int = 0, restart_window: float = 600.0):
        """``max_client_jobs``: the jobs one client may have in flight (None: half of max_batch + max_queue, at
        least max_batch); ``stall_timeout``: seconds without a turn of the decode loop that count as a stall (None
        or 0: never); ``restarts`` within ``restart_window`` seconds: engine failures recovered by a restart
        (module docstring)."""
        self.args, self.max_batch, self.max_queue = args, max_batch, max_queue
        capacity = max_batch + max_queue
        self.client_limit = min(capacity, max_client_jobs or max(max_batch, capacity // 2))
        self.stall_timeout = stall_timeout or None
        self.max_restarts, self.restart_window = max(0, int(restarts)), float(restart_window)
        self.proc = self.conn = self.loop = None
        self.pulse = Pulse()
        self.routes: dict = {}            # key -> (queue, index, ticket) until the job's end is read
        self.per_client: collections.Counter = collections.Counter()     # client -> its jobs in flight (> 0 only)
        self.asks: dict = {}              # ask id -> Future
        self._keys, self._ask_ids = itertools.count(), itertools.count()
        self.closing = False
        self.lost: str | None = None      # why the engine is gone (set once its pipe ended unexpectedly)
        self.died: str | None = None      # the loop's own last words (its Died message)
        self.down: str | None = None      # why the engine is unavailable while it is being replaced
        self.fatal: str | None = None     # why the server gives up (on_fatal was called)
        self.on_fatal = None              # called once with that reason (the server stops: exit status 3)
        self.restarts = 0                 # engine restarts so far
        self._restarted: collections.deque = collections.deque()     # their times (monotonic)
        self._gen = 0                     # the engine's incarnation (a stale sender's report is ignored)
        self._watch_task = None
        self.outgoing: queues.SimpleQueue = queues.SimpleQueue()      # messages for the sender thread (None: stop)
        self._sender: threading.Thread | None = None

    # -- life -------------------------------------------------------------------------------------------------
    def start(self) -> dict:
        """Spawn the engine and wait until it loaded the model: its ``Ready`` info."""
        atexit.register(self.close)       # before multiprocessing's own exit hook joins the child
        return self._spawn()

    def _spawn(self) -> dict:
        """A new engine process (its pipe, its pulse, its sender thread), loaded: its ``Ready`` info."""
        from .engine_process import main

        ctx = multiprocessing.get_context("spawn")
        pulse = Pulse.shared(ctx)
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=main, args=(child, self.args, pulse.a), name="setdiff-engine", daemon=False)
        proc.start()
        child.close()
        self.proc, self.conn = proc, conn
        while not conn.poll(0.5):
            if not proc.is_alive() or self.closing:
                break
        try:
            message = conn.recv() if conn.poll(0) else None      # (its end of file: EOFError)
        except (EOFError, OSError):
            message = None
        if message is None:
            proc.join(timeout=5)
            raise RuntimeError(f"the decoding engine exited with status {proc.exitcode} while loading the model "
                               f"(its messages are above)")
        if isinstance(message, Fatal):
            proc.join(timeout=10)
            raise (ValueError if message.user else RuntimeError)(message.message)
        self._gen += 1
        self.pulse, self.outgoing, self.died, self.lost = pulse, queues.SimpleQueue(), None, None
        self._sender = threading.Thread(target=self._send_loop, args=(conn, self.outgoing, self._gen),
                                        name="setdiff-engine-sender", daemon=True)
        self._sender.start()
        return message.info

    def _send_loop(self, conn, outgoing, gen: int) -> None:
        while (message := outgoing.get()) is not None:
            try:
                conn.send(message)
            except (OSError, EOFError):           # the engine is gone: the reader sees its end of file
                try:
                    self.loop.call_soon_threadsafe(self._lost, gen)
                except (AttributeError, RuntimeError):    # no loop yet, or it is closed
                    pass
                return

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.lost is None and self.down is None and not self.closing

    @property
    def unavailable(self) -> str | None:
        """Why no request can be served now (None: it can)."""
        if self.closing:
            return self.fatal or "the server is shutting down"
        return self.fatal or self.down or self.lost or self._failure()

    def health(self) -> dict:
        """/health's body: ``status`` ok or unavailable (with its ``reason``), the loop's vital signs
        (:meth:`~.pulse.Pulse.read`), the engine's restarts so far."""
        reason = self.unavailable
        out = {"status": "unavailable" if reason else "ok", **self.pulse.read(), "engine_restarts": self.restarts}
        if reason is not None:
            out["reason"] = reason
        return out

    def _fail_routes(self, status: int, message: str) -> None:
        for queue, i, ticket in self.routes.values():
            ticket.done = True
            queue.put_nowait((i, "error", (status, message)))
        self.routes.clear()
        self.per_client.clear()
        for future in self.asks.values():
            if not future.done():
                future.set_exception(EngineGone(message))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine (queued jobs fail, running ones are cancelled) and wait for it; kill it after
        ``timeout`` seconds."""
        if self.proc is None or self.closing:
            return
        self.closing = True
        if self._watch_task is not None and self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._watch_task.cancel)
            except RuntimeError:
                pass
        self._detach()
        if self._sender is not None:
            self.outgoing.put(Close())
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
        """Read the engine's messages on ``loop`` (the HTTP server's event loop) and watch it there."""
        if self.loop is loop:
            return
        self.loop = loop
        self._attach_reader()
        self._watch_task = loop.create_task(self._watch())

    def _attach_reader(self) -> None:
        self.loop.add_reader(self.conn.fileno(), self._readable)

    def _send(self, message) -> None:
        self.outgoing.put(message)

    def fault(self, kind: str) -> None:
        """A test's fault for the engine's loop (honoured only with ``args.fault_injection``)."""
        self._send(Fault(kind))

    def submit(self, specs: list, queue, client: str = "") -> list:
        """Queue ``specs`` (:class:`~.messages.JobSpec` without keys: given here) of ``client``, all or none; spec
        i's events go to ``queue`` as (i, event, payload)."""
        if not self.alive:
            raise EngineGone(self.unavailable or "the server is shutting down")
        n, capacity = len(specs), self.max_batch + self.max_queue
        if n > self.client_limit:
            raise NeverFits(n, self.client_limit, capacity)
        inflight = len(self.routes)
        if inflight + n - self.max_batch > self.max_queue:
            raise QueueFull(f"the queue is full ({max(0, inflight - self.max_batch)} waiting, limit "
                            f"{self.max_queue}); retry later")
        mine = self.per_client.get(client, 0)
        if mine + n > self.client_limit:
            raise QueueFull(f"this client has {mine} jobs in flight and may have at most {self.client_limit} "
                            f"(--max-client-jobs); retry when some have ended")
        tickets = []
        for i, spec in enumerate(specs):
            spec.key, spec.client = next(self._keys), client
            ticket = Ticket(spec.key, client)
            self.routes[spec.key] = (queue, i, ticket)
            tickets.append(ticket)
        self.per_client[client] = mine + n
        self._send(Submit(specs))
        return tickets

    def _ended(self, ticket: Ticket) -> None:
        ticket.done = True
        left = self.per_client.get(ticket.client, 0) - 1
        if left > 0:
            self.per_client[ticket.client] = left
        else:                                        # no entry kept for a client without jobs: bounded
            self.per_client.pop(ticket.client, None)

    def cancel(self, ticket: Ticket, reason: str = "cancelled") -> None:
        if not ticket.done and self.alive:
            self._send(Cancel(ticket.key, reason))

    async def ask(self, what: str, timeout: float = 30.0):
        """The engine's answer to ``what`` (``health``, ``metrics``)."""
        if not self.alive:
            raise EngineGone(self.unavailable or "the server is shutting down")
        i = next(self._ask_ids)
        future = self.asks[i] = asyncio.get_running_loop().create_future()
        try:
            self._send(Ask(i, what))
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
            self._lost(self._gen)

    def _dispatch(self, message) -> None:
        if isinstance(message, Events):
            for key, event, payload in message.events:
                route = self.routes.get(key)
                if route is None:
                    continue
                queue, i, ticket = route
                if event in ("done", "error"):
                    self._ended(ticket)
                    del self.routes[key]
                queue.put_nowait((i, event, payload))
        elif isinstance(message, Died):
            self.died = message.message
        elif isinstance(message, Answer):
            future = self.asks.get(message.ask_id)
            if future is not None and not future.done():
                future.set_result(message.value)

    def _lost(self, gen: int | None = None) -> None:
        """The engine's pipe ended: every job in flight fails, every question fails (at once; the watchdog then
        restarts the engine or gives up)."""
        if self.lost is not None or self.closing or (gen is not None and gen != self._gen) or self.down:
            return
        self._detach()
        self.proc.join(timeout=0.5)                  # its exit status, when it has one already
        self.lost = (f"the decoding engine exited (status {self.proc.exitcode}); its messages are in the server's "
                     f"log")
        self._fail_routes(503, f"{self.lost}; retry the request")


__all__ = ["EngineClient", "EngineGone", "NeverFits", "QueueFull", "Ticket"]
