"""The admission policy: which waiting jobs may start, and when a job is refused or expires; no decoding here
(:mod:`.execution` runs what is admitted, :mod:`.scheduler` joins the two in one loop).

    submit     jobs join the queue, all or none (:class:`~.messages.QueueFull` beyond ``max_queue``, or when the
               loop is closing or dead)
    expire     queued jobs past their deadline fail (504); running ones are flagged cancelled (their decode
               retires them before the next step)
    take       the jobs that start now: the clients in turn (:class:`~.bounded.FairQueue`), none beyond its row
               share (:class:`RowShares`, below)

Who takes the batch's free rows: fair turns, and a light client's row share beside a flood (issue 57).

The queue (:class:`~.bounded.FairQueue`) gives the next free row to the next client in turn. That alone left a
light client's request decoding in a batch the flood had filled: on CPU a decode step's cost grows with its rows
(the main job's model: a batch-8 step about 3x a batch-1 step, docs/results.md "Hostile clients"), so each of the
light client's tokens cost ~3x, whatever the order (its p99 x2.98 beside a flood). So while more than one client
has work, no client holds more than its share of the batch's rows:

    active  = the clients with a job queued or running, and those whose last job left less than ``linger``
              seconds ago
    share   = max_batch                          when at most one client is active (a client alone: the whole
                                                 batch, so one client's throughput is unchanged)
            = ``row_share``                      when set (``serve.py --client-row-share``; max_batch: no cap;
                                                 by default :data:`CPU_ROW_SHARE` = 2 on a CPU,
                                                 :func:`default_row_share`)
            = ceil(max_batch / |active|)         otherwise (the default on a GPU)

A job of a client already holding ``share`` rows stays queued (it is not refused: the queue bounds are unchanged)
and goes first among the waiting once its client is under its share again (its turn is kept). Rows are never
taken back from a running job: a flood that filled the batch while it was alone keeps those rows until its jobs
end, and a newcomer gets the first row that frees (the flood is not given another while it is over its share).

Why ceil(max_batch / clients): with a flood and one light client it is half the batch, so the light client's
row decodes in a batch of at most max_batch / 2 + its own rows (on the main job's CPU a 5-row step costs about
half of what an 8-row one does over a 1-row one); with several floods the batch still fills (|active| shares of
ceil(max_batch / |active|) cover it) in equal parts. The price is the flood's throughput while a light client
has work, never a lone client's.

Why 2 rows on a CPU by default (issue 57, docs/results.md "The default row share"): there a step's cost grows
with its rows, so the light client's latency depends on how many rows the flood decodes beside it. Measured on the
main job (4 rotated runs each, the well-behaved client's p99 beside a flood over its p99 alone): ceil(8 / 2) = 4
rows x2.33 +- 0.76, 2 rows x1.91 +- 0.64, 1 row x1.67 +- 0.48; the flood kept 984, 702 and 480 tokens/s while the
light client had work. 2 rows is the default: under the 2x target on average at 71 % of the flood's throughput
(1 row: 49 %). On a GPU a step's cost barely grows with its rows (weight-bound), so the ceil rule stays.

Why ``linger`` (:data:`LINGER_S`, 0.1 s): a client that sends its next request as soon as the last was answered
(a closed loop, one request at a time) has no job for the few milliseconds between; without the linger the flood
took every row freed in that gap at the next step, and the client came back to a full batch. The cost: after a
client's last request, the others stay within their shares for 0.1 s more.
"""
from __future__ import annotations

import collections
import math
import time

from .bounded import FairQueue
from .messages import QueueFull

LINGER_S = 0.1                   # seconds a client whose last job left still counts as active (module docstring)
CPU_ROW_SHARE = 2                # rows one client may hold beside others on a CPU by default (module docstring)


def default_row_share(row_share: int | None, max_batch: int, device_type: str) -> int | None:
    """The server's row share: ``row_share`` when given, else :data:`CPU_ROW_SHARE` (at most ``max_batch``) on a
    CPU and None (the ceil rule) elsewhere (module docstring)."""
    if row_share is not None:
        return row_share
    return min(CPU_ROW_SHARE, max_batch) if device_type == "cpu" else None


class RowShares:
    """The row-share policy (module docstring): :meth:`take` picks the queued jobs that start now."""

    def __init__(self, max_batch: int, row_share: int | None = None, linger: float = LINGER_S, clock=time.monotonic):
        if row_share is not None and not 1 <= row_share <= max_batch:
            raise ValueError(f"--client-row-share must be between 1 and --max-batch ({max_batch}), got {row_share}")
        self.max_batch, self.row_share, self.linger, self.clock = max_batch, row_share, float(linger), clock
        self._left: dict = {}            # client -> when its last job left (pruned after ``linger``: bounded)

    def share(self, active: int) -> int:
        """The rows one client may hold while ``active`` clients have work."""
        if active <= 1:
            return self.max_batch
        if self.row_share is not None:
            return self.row_share
        return math.ceil(self.max_batch / active)

    def left(self, client) -> None:
        """A job of ``client`` left the batch (it lingers: module docstring)."""
        self._left[client] = self.clock()

    def lingering(self) -> set:
        """The clients whose last job left less than ``linger`` seconds ago (older entries are dropped)."""
        now = self.clock()
        self._left = {c: t for c, t in self._left.items() if now - t < self.linger}
        return set(self._left)

    def take(self, queue: FairQueue, running, free: int) -> list:
        """Up to ``free`` jobs from ``queue`` (in the clients' turns) that start now beside the ``running`` jobs,
        no client beyond its share (module docstring)."""
        held = collections.Counter(job.client for job in running)
        active = set(held) | set(queue.waiting()) | self.lingering()
        share = self.share(len(active))
        jobs = []
        while free > len(jobs) and queue:
            job = queue.popleft(lambda client: held[client] < share)
            if job is None:                # every waiting client holds its share: the rest stays queued
                break
            held[job.client] += 1
            jobs.append(job)
        return jobs


class Admission:
    """The queue and the policy over it (module docstring); the caller holds the scheduler's lock."""

    def __init__(self, max_batch: int, max_queue: int, row_share: int | None = None):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_queue ({max_queue}) must be >= 1")
        self.max_batch, self.max_queue = max_batch, max_queue
        self.queue = FairQueue()         # waiting jobs, one FIFO per client, taken round-robin
        self.shares = RowShares(max_batch, row_share)

    def submit(self, jobs: list, refusal: str | None = None) -> None:
        """Queue ``jobs``, all or none (``refusal``: why nothing may be queued now, e.g. shutting down)."""
        if refusal is not None:
            raise QueueFull(refusal)
        if len(self.queue) + len(jobs) > self.max_queue:
            raise QueueFull(f"the queue is full ({len(self.queue)} waiting, limit {self.max_queue}); retry later")
        self.queue.extend(jobs)

    def withdraw(self, job, reason: str) -> bool:
        """Take ``job`` out of the queue, ended with ``reason`` (False: it is not queued)."""
        if job not in self.queue:
            return False
        self.queue.remove(job)
        job.reason = reason
        job.finish(None)
        return True

    def expire(self, running) -> None:
        now = time.monotonic()
        for job in [j for j in self.queue if j.deadline is not None and now > j.deadline]:
            self.queue.remove(job)
            job.fail(504, f"the request timed out after {job.timeout:g} s in the queue")
        for job in running:
            if job.deadline is not None and now > job.deadline and job.reason is None and not job.done:
                job.reason = "timeout"
                job.cancelled = True

    def take(self, running: dict) -> list:
        """The queued jobs that start now beside ``running`` (key -> job), their start time set."""
        jobs = self.shares.take(self.queue, running.values(), self.max_batch - len(running))
        now = time.monotonic()
        for job in jobs:
            job.started = now
        return jobs

    def close(self) -> None:
        """Every queued job fails (503)."""
        for job in list(self.queue):
            job.fail(503, "the server is shutting down")
        self.queue.clear()


__all__ = ["Admission", "RowShares", "LINGER_S"]
