"""Bounded structures for what clients control: a least-recently-used cache and the scheduler's fair queue.

* :class:`LRU`: every cache keyed by client input (the chat renderers per ``chat_template_kwargs``) holds at most
  ``size`` entries; the least recently used goes first (``serve.py --chat-cache-size``).
* :class:`FairQueue`: the jobs waiting for a batch row, one FIFO per client (an API key, else the client's
  address: :func:`client_id`), taken round-robin, least recently served client first (a client that arrives
  with nothing queued goes ahead of those already served): the next free row goes to the next client in turn,
  so a client with one job waits for one row to free whatever another client has queued. The total is bounded
  by the admission checks of the HTTP side (:mod:`.client`), not here; how many rows a client may hold at once is
  :mod:`.admission`'s.
"""
from __future__ import annotations

import collections


class LRU:
    """A mapping of at most ``size`` entries (>= 1), the least recently used evicted first."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"an LRU cache needs a size >= 1, got {size}")
        self.size = size
        self._d: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, make):
        """The entry of ``key``, made by ``make()`` when absent (an exception leaves the cache as it was)."""
        if key in self._d:
            self._d.move_to_end(key)
            return self._d[key]
        value = make()
        self._d[key] = value
        while len(self._d) > self.size:
            self._d.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key) -> bool:
        return key in self._d


class FairQueue:
    """Jobs by client (``job.client``), taken round-robin (module docstring); the rest is a deque's interface as
    the scheduler uses it."""

    def __init__(self):
        self._by: dict = {}              # client -> deque of its jobs (clients with jobs waiting only)
        self._served: dict = {}          # client -> the tick of its last job taken (-1: none since it arrived)
        self._tick = 0
        self._n = 0

    def append(self, job) -> None:
        client = getattr(job, "client", "")
        if client not in self._by:
            self._by[client] = collections.deque()
            self._served[client] = -1
        self._by[client].append(job)
        self._n += 1

    def extend(self, jobs) -> None:
        for job in jobs:
            self.append(job)

    def popleft(self, allowed=None):
        """The oldest job of the client whose turn it is (the least recently served); it goes last in turn.
        ``allowed(client)``: only such clients' jobs are taken (None when no waiting client is allowed; the
        others keep their turn: :mod:`.admission`)."""
        if not self._n:
            raise IndexError("pop from an empty FairQueue")
        clients = self._served if allowed is None else [c for c in self._served if allowed(c)]
        if not clients:
            return None
        client = min(clients, key=self._served.__getitem__)          # O(clients waiting): bounded by the queue
        jobs = self._by[client]
        job = jobs.popleft()
        self._tick += 1
        self._served[client] = self._tick
        if not jobs:
            self._forget(client)
        self._n -= 1
        return job

    def _forget(self, client) -> None:
        del self._by[client]
        del self._served[client]

    def remove(self, job) -> None:
        client = getattr(job, "client", "")
        jobs = self._by[client]
        jobs.remove(job)                     # ValueError when absent, as a deque's
        self._n -= 1
        if not jobs:
            self._forget(client)

    def clear(self) -> None:
        self._by.clear()
        self._served.clear()
        self._n = 0

    def __contains__(self, job) -> bool:
        return job in self._by.get(getattr(job, "client", ""), ())

    def __iter__(self):
        return iter([j for jobs in self._by.values() for j in jobs])

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def clients(self) -> int:
        return len(self._by)

    def waiting(self) -> list:
        """The clients with jobs waiting."""
        return list(self._by)


def client_id(scope: dict, keys: tuple = ()) -> str:
    """Who sent a request, for fair admission: its API key's index when the server has several keys (each
    tenant its own), else the client's address (not the port: a client's many connections are one client)."""
    if len(keys) > 1:
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        for i, key in enumerate(keys):
            if given == b"Bearer " + key:
                return f"key{i}"
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:?"


__all__ = ["LRU", "FairQueue", "client_id"]
