"""One KV-cache budget across the scheduler's decodes, and the registry of the shared ones.

Every decode (:class:`~.sessions.Decode`) holds a KV cache of ``rows x width`` canvas positions (per layer: the
model's ``cache_shape``). Live decodes (with jobs) are the batch's; a shared decode left without jobs may rest,
kept for the next job of its options and width bucket so that its cache is not allocated and zeroed again (at
GPT-2-small shape ~12 ms per new decode). What rests is bounded here, for all decodes together:

    held(live, resting) = sum over live and resting decodes of rows x width            (positions)
    resting decodes are let go, oldest first, while
        len(resting) > IDLE_DECODES        or        held > ``positions``   (None: no bound in positions)

Live decodes are never let go (their jobs decode; the batch itself is bounded by ``max_batch`` rows); the budget
decides only what is kept idle, so the tokens never depend on it. A decode let go is forgotten: the registry keeps
no reference, its cache is freed with it.

The registry: (options key, width bucket, rows) -> the shared decode a job of those joins while it has room
(:meth:`KVBudget.find`); a full one is replaced by a new one (:meth:`register`), the full one runs on unregistered
and is dropped when its last job leaves.
"""
from __future__ import annotations

IDLE_DECODES = 4                # shared decodes kept without jobs (module docstring)


class KVBudget:
    """The shared decodes and the resting ones, within the budget (module docstring)."""

    def __init__(self, positions: int | None = None):
        if positions is not None and positions < 1:
            raise ValueError(f"a KV-cache budget needs positions >= 1 (or None: no bound), got {positions}")
        self.positions = positions
        self.shared: dict = {}           # (session key, width, rows) -> its shared Decode
        self.resting: list = []          # shared decodes without jobs, oldest first

    def find(self, key):
        """The registered shared decode of ``key`` with a free row, or None."""
        d = self.shared.get(key)
        return d if d is not None and d.has_room() else None

    def register(self, key, d) -> None:
        self.shared[key] = d

    def registered(self, d) -> bool:
        return any(v is d for v in self.shared.values())

    def wake(self, d) -> None:
        """A resting decode takes a job again (it is live)."""
        if d in self.resting:
            self.resting.remove(d)

    def rest(self, d, live: list) -> bool:
        """``d`` has no job left: kept resting when registered (True), within the budget beside ``live``."""
        if not self.registered(d):
            return False
        self.resting.append(d)
        self.trim(live)
        return True

    def forget(self, d) -> None:
        """``d`` is gone (dropped, failed, let go): no reference is kept."""
        self.shared = {k: v for k, v in self.shared.items() if v is not d}
        if d in self.resting:
            self.resting.remove(d)

    def held(self, live: list) -> int:
        """The KV positions of ``live`` and the resting decodes together."""
        return sum(d.rows * d.width for d in (*live, *self.resting))

    def trim(self, live: list) -> None:
        """Let go of resting decodes, oldest first, until within the budget (module docstring)."""
        while self.resting and (len(self.resting) > IDLE_DECODES
                                or (self.positions is not None and self.held(live) > self.positions)):
            self.forget(self.resting[0])


__all__ = ["KVBudget", "IDLE_DECODES"]
