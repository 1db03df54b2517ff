"""Straggler report: which rank is slow, every log interval.

In a synchronous step every rank finishes together, so the step's wall time cannot tell ranks apart; what
differs is how long each rank works before it waits for the others. A rank's *compute time* for a step is
its wall time minus the time it spent waiting for the data-parallel gradient all-reduce to complete
(``GradReducer.waited``: the buckets' all-reduces are launched during the backward and waited for at its
end, where a fast rank waits for the slowest). Inside a tensor- or pipeline-parallel group the layers'
own collectives make the members wait for each other, so a slow rank shows up as its whole group being
slow; the report then names the slow data-parallel replica.

Every log interval the ranks all-gather their mean compute time per step over the interval (one small
collective); rank 0 logs ``straggler/{min,median,max}_s`` and ``straggler/slowest_rank``, and warns once
a rank has been the slowest by more than ``fault.straggler_factor`` x the median at
``fault.straggler_patience`` log intervals in a row.
"""
from __future__ import annotations

import statistics

import torch.distributed as dist


class StragglerMonitor:
    def __init__(self, factor: float, patience: int, warn=print):
        self.factor, self.patience, self.warn = factor, patience, warn
        self.compute = 0.0
        self.steps = 0
        self.suspect: tuple[int, int] | None = None        # (rank, intervals in a row)

    def record(self, wall: float, waited: float) -> None:
        """One step: its wall time and the time spent waiting for the other ranks."""
        self.compute += max(wall - waited, 0.0)
        self.steps += 1

    def report(self) -> dict:
        """Collective (every rank, at log intervals): the interval's statistics, on every rank."""
        mine = self.compute / max(self.steps, 1)
        self.compute, self.steps = 0.0, 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        times = [None] * world
        if world > 1:
            dist.all_gather_object(times, mine)
        else:
            times = [mine]
        return self.judge(times)

    def judge(self, times: list[float]) -> dict:
        """Statistics of per-rank compute times, and the warning once a rank lags ``patience`` times in a row."""
        slow = max(range(len(times)), key=lambda r: (times[r], -r))
        fast = min(range(len(times)), key=lambda r: (times[r], r))
        median = statistics.median(times)
        lagging = median > 0 and times[slow] > self.factor * median
        if lagging:
            run = self.suspect[1] + 1 if self.suspect is not None and self.suspect[0] == slow else 1
            self.suspect = (slow, run)
            if run == self.patience:
                self.warn(f"warning: straggler: rank {slow} has taken {times[slow] / median:.2f}x the median rank's "
                          f"compute time per step ({times[slow] * 1e3:.1f} ms vs {median * 1e3:.1f} ms) at {run} log "
                          f"intervals in a row (fault.straggler_factor={self.factor}); look at its host")
        else:
            self.suspect = None
        return {"straggler/min_s": times[fast], "straggler/median_s": median, "straggler/max_s": times[slow],
                "straggler/fastest_rank": fast, "straggler/slowest_rank": slow,
                "straggler/max_over_median": times[slow] / median if median > 0 else 1.0}


__all__ = ["StragglerMonitor"]
