"""The engine process: it owns the model and the scheduler loop; the HTTP side talks to it over one pipe.

The HTTP process (uvicorn, :mod:`.app`) parses requests and writes SSE chunks; all of that is Python, and in one
process it shares the GIL with the decode loop, whose every torch operator must take the GIL back when it returns
(docs/results.md "Serving": 10-20 % of the tokens/s at 8 streams on the main job). So the decode loop runs in a
process of its own (as vLLM's engine core and API server), started by :class:`~.client.EngineClient` with
``multiprocessing``'s spawn, connected by a ``Pipe`` (a socket pair: no listening socket, nothing to authenticate).

Messages: the typed ones of :mod:`.messages` (pickled by :class:`multiprocessing.connection.Connection`):
:class:`~.messages.Submit`, :class:`~.messages.Cancel`, :class:`~.messages.Ask`, :class:`~.messages.Fault` and
:class:`~.messages.Close` in; :class:`~.messages.Ready` or :class:`~.messages.Fatal` (loading), then
:class:`~.messages.Events`, :class:`~.messages.Died` and :class:`~.messages.Answer` out.

Threads here: the scheduler's loop (the only one that touches the model) and the main thread, blocked in the
pipe's ``recv`` (no GIL held) but for the few microseconds a message takes. Sends from both are serialized by a
lock. The engine ignores SIGINT and SIGTERM (a terminal's Ctrl-C, systemd's stop reach the whole process group):
the HTTP side drains its requests and then sends :class:`~.messages.Close`; if the HTTP process dies, the pipe's end
of file stops the engine.

The loop's vital signs are also in shared memory (:class:`~.pulse.Pulse`, made by the HTTP side and handed to
:func:`main`): the HTTP side reads them without a message (/health, its watchdog: :mod:`.client`). An event that
cannot be pickled fails its own job (500) instead of the step's hand-over.
"""
from __future__ import annotations

import os
import signal
import threading

from .admission import default_row_share
from .job import Job
from .messages import Answer, Ask, Cancel, Close, Died, Events, Fatal, Fault, QueueFull, Ready, Submit
from .metrics import Metrics
from .outbox import Outbox
from .pulse import Pulse
from .scheduler import Scheduler


def load_model(args):
    """(model, objective, tokenizer, config) as the server decodes: ``args`` are ``serve.parse_args``'s."""
    from setdiff_mega.checkpoint import load_model as load
    from setdiff_mega.inference.api import check_vocab
    from setdiff_mega.inference.engine import decoding_model

    model, objective, tok, cfg = load(args.checkpoint, weights=args.weights)
    model = decoding_model(model, cfg, tok, args.engine, args.decode_weights)
    check_vocab(model, tok)
    model.eval()
    return model, objective, tok, cfg


class EngineCore:
    """The scheduler and the pipe: jobs in, events out (module docstring)."""

    def __init__(self, scheduler: Scheduler, conn, metrics: Metrics, interval: float = 0.0, rate: float = 0.0,
                 faults: bool = False):
        self.scheduler, self.conn, self.metrics, self.faults = scheduler, conn, metrics, faults
        self.jobs: dict = {}              # key -> Job, until its end went over
        self._lock = threading.Lock()
        self.outbox = Outbox(self._events, scheduler.in_loop, interval, rate)
        scheduler.on_step_end = self.outbox.flush
        scheduler.stream_due = self.outbox.due
        scheduler.on_death = self._died

    def send(self, message) -> None:
        with self._lock:
            self.conn.send(message)

    def _events(self, batch: list) -> None:
        for key, event, _ in batch:
            if event in ("done", "error"):
                self.jobs.pop(key, None)
        try:
            self.send(Events(batch))
        except (OSError, EOFError):
            raise
        except Exception:                 # noqa: BLE001 (an event that cannot be pickled: nothing was written)
            for key, event, payload in batch:
                try:
                    self.send(Events([(key, event, payload)]))
                except (OSError, EOFError):
                    raise
                except Exception as e:    # noqa: BLE001 (that job fails in one line; the others went over)
                    self.jobs.pop(key, None)
                    self.send(Events([(key, "error", (500, f"an event of this request could not be sent "
                                                         f"({type(e).__name__}: {e})"[:300]))]))

    def _died(self, message: str) -> None:
        try:
            self.send(Died(message))
        except (OSError, EOFError):
            pass

    def _answer(self, what: str):
        s = self.scheduler
        if what == "health":
            return {**s.pulse.read(), "running": len(s.running), "queued": len(s.queue)}   # the live counts win
        if what == "metrics":
            return self.metrics.render()
        raise ValueError(f"unknown question {what!r}")

    def handle(self, message) -> bool:
        """One message from the HTTP side (:mod:`.messages`); False for :class:`~.messages.Close`."""
        if isinstance(message, Submit):
            jobs = [Job(s.ids, s.config, self.outbox.emitter(s.key), s.stops, s.timeout, self.scheduler.tokenizer,
                        key=s.key, arrival=s.arrival, trace=s.trace, client=s.client) for s in message.specs]
            self.jobs.update((job.key, job) for job in jobs)
            try:
                self.scheduler.submit(jobs)
            except QueueFull as e:            # never expected (the HTTP side bounds the queue): each job fails alone
                status = 503 if self.scheduler.closing or self.scheduler.error else 429
                for job in jobs:
                    job.fail(status, str(e))
        elif isinstance(message, Cancel):
            job = self.jobs.get(message.key)
            if job is not None:
                self.scheduler.cancel(job, message.reason)
        elif isinstance(message, Ask):
            self.send(Answer(message.ask_id, self._answer(message.what)))
        elif isinstance(message, Fault) and self.faults:
            self.scheduler.fault = message.kind
        elif isinstance(message, Close):
            return False
        return True

    def run(self) -> None:
        """Serve the pipe until ``close`` or its end of file; the scheduler is closed either way."""
        self.scheduler.start()
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):   # the HTTP process is gone
                    break
                if not self.handle(message):
                    break
        finally:
            self.scheduler.close()


def serving_threads(requested: int | None) -> int:
    """The engine's torch intra-op threads: ``requested``, else the cores this process may use minus one (at least
    1). Measured on 2 cores (docs/results.md "Serving"): with both cores in torch's pool the forward doubles, its
    threads competing with the HTTP process and the clients for the same two cores."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def _fatal(e: BaseException) -> Fatal:
    """The :class:`~.messages.Fatal` message (user error?, one line) for a failure to load."""
    from setdiff_mega.errors import USER_ERRORS

    user = isinstance(e, (*USER_ERRORS, FileNotFoundError, KeyError, ValueError))   # what the CLIs print as one line
    text = str(e.args[0] if isinstance(e, KeyError) and e.args else e) if user else f"{type(e).__name__}: {e}"
    return Fatal(user, " ".join(text.split()))


def _device_type(model) -> str:
    """The device the model decodes on ("cpu" when it has no parameters to ask)."""
    try:
        return next(model.parameters()).device.type
    except (AttributeError, StopIteration, TypeError):
        return "cpu"


def main(conn, args, pulse_array=None) -> None:
    """The engine process (``multiprocessing`` spawn target): load, say ``ready``, serve the pipe; the loop's
    vital signs go to ``pulse_array`` (:class:`~.pulse.Pulse`)."""
    import torch

    from setdiff_mega.inference.engine import weights_format

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        torch.set_num_threads(serving_threads(args.threads))
        model, objective, tok, cfg = load_model(args)
        metrics = Metrics()
        L = cfg.data.seq_length
        share = default_row_share(getattr(args, "client_row_share", None), args.max_batch, _device_type(model))
        scheduler = Scheduler(model, tok, objective, max_batch=args.max_batch, metrics=metrics,
                              max_queue=args.max_queue + args.max_batch, width=L + args.max_tokens_limit,
                              pulse=Pulse(pulse_array), row_share=share)
    except Exception as e:                # noqa: BLE001 (reported to the HTTP side as one line)
        conn.send(_fatal(e))
        return
    try:
        conn.send(Ready({"config": cfg, "tokenizer": tok, "method": objective.name, "max_batch": args.max_batch,
                         "decode_weights": weights_format(model)}))
    except OSError:                       # the HTTP process stopped while the model loaded
        return
    core = EngineCore(scheduler, conn, metrics, max(0.0, args.stream_interval), max(0.0, args.stream_chunk_rate),
                      faults=bool(getattr(args, "fault_injection", False)))
    core.run()


__all__ = ["EngineCore", "load_model", "main", "serving_threads"]
