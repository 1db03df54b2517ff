"""What the two processes of the server say to each other, as types: the messages over the pipe between the HTTP
process (:mod:`.client`, :mod:`.app`) and the engine process (:mod:`.engine_process`), and the refusals both sides
raise. Neither side imports the other's machinery for them (the HTTP process never imports the scheduler).

HTTP side -> engine (each pickled by :class:`multiprocessing.connection.Connection`):

    Submit(specs)            queue jobs (:class:`JobSpec`; the HTTP side already bounded the queue: 429 there)
    Cancel(key, reason)      stop a job (client gone, timeout); unknown keys (already ended) are ignored
    Ask(ask_id, what)        what: "health" -> {"running", "queued", "loop", ...}; "metrics" -> Prometheus text
    Fault(kind)              a test's fault for the loop ("die", "stall"), honoured only when the server was built
                             with ``args.fault_injection`` (no flag sets it)
    Close()                  queued jobs fail (503), running ones are cancelled, the engine exits

engine -> HTTP side:

    Ready(info)              loaded: {"config", "tokenizer", "method", "max_batch", "decode_weights"} (what the HTTP
                             side parses requests with, and the decode-weights format auto resolved to; the model
                             itself stays in the engine)
    Fatal(user, message)     loading failed (one line; the HTTP side raises it: ValueError for a user's error such
                             as a missing checkpoint, RuntimeError otherwise)
    Events(events)           a step's events [(key, event, payload), ...] (:mod:`.outbox`), or one emitted off
                             the loop; event is "delta", "trace", "done" or "error" (:mod:`.job`)
    Died(message)            the scheduler's loop ended on an error (one line; its jobs already failed)
    Answer(ask_id, value)    the answer to an :class:`Ask`

Refusals: :class:`QueueFull` (HTTP 429: the queue or the client's share is full, retry later), :class:`NeverFits`
(400: more jobs than one client may ever have in flight), :class:`EngineGone` (503: no engine to serve it).
"""
from __future__ import annotations

from dataclasses import dataclass, field


class QueueFull(Exception):
    """The waiting queue, or a client's share of it, is full (HTTP 429)."""


class EngineGone(RuntimeError):
    """The engine process is not running (HTTP 503)."""


class NeverFits(ValueError):
    """A request of more jobs than one client may ever have in flight (HTTP 400: it can never be admitted)."""

    def __init__(self, jobs: int, limit: int, capacity: int):
        super().__init__(f"{jobs} jobs, more than the {limit} one client may have in flight")
        self.jobs, self.limit, self.capacity = jobs, limit, capacity


@dataclass
class JobSpec:
    """A job as the HTTP side sends it (:class:`~.job.Job` is built in the engine, with its tokenizer)."""
    key: int
    ids: list
    config: object                    # GenerationConfig
    stops: tuple = ()
    timeout: float | None = None
    trace: bool = False
    arrival: float = 0.0              # time.monotonic() at the HTTP side (one clock for both processes)
    client: str = ""                  # who sent it (.bounded.client_id: fair admission)


# -- HTTP side -> engine --------------------------------------------------------------------------------------------
@dataclass
class Submit:
    specs: list[JobSpec]


@dataclass
class Cancel:
    key: int
    reason: str = "cancelled"


@dataclass
class Ask:
    ask_id: int
    what: str


@dataclass
class Fault:
    kind: str


@dataclass
class Close:
    pass


# -- engine -> HTTP side --------------------------------------------------------------------------------------------
@dataclass
class Ready:
    info: dict = field(default_factory=dict)


@dataclass
class Fatal:
    user: bool
    message: str


@dataclass
class Events:
    events: list                      # [(key, event, payload), ...]


@dataclass
class Died:
    message: str


@dataclass
class Answer:
    ask_id: int
    value: object


__all__ = ["QueueFull", "EngineGone", "NeverFits", "JobSpec", "Submit", "Cancel", "Ask", "Fault", "Close", "Ready",
           "Fatal", "Events", "Died", "Answer"]
