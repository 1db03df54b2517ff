"""Stop signals at step boundaries: SIGTERM (what schedulers send before a kill), SIGUSR1 (Slurm's
``--signal``) and SIGINT (Ctrl-C; a second Ctrl-C aborts at once, without saving) set a flag; at the end of
the current step all ranks agree (an all-reduce, since a signal may reach only some ranks), and the trainer
saves and leaves the loop cleanly.
"""
from __future__ import annotations

import signal
import sys

import torch
import torch.distributed as dist


class ExitSignals:
    """SIGTERM / SIGUSR1 / SIGINT -> a flag checked (and agreed on by all ranks) at step boundaries; a second
    SIGINT raises KeyboardInterrupt (abort now, no save)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.received: int | None = None
        self.interrupted = False
        self._previous = {}

    def __enter__(self):
        if self.enabled:
            try:
                for s in self.SIGNALS:
                    self._previous[s] = signal.signal(s, self._handler)
            except ValueError:           # not the main thread: leave signal handling to the caller
                self.enabled = False
        return self

    def _handler(self, signum, frame):
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
            print("\nSIGINT: saving at the end of this step, then stopping (Ctrl-C again aborts without saving)",
                  file=sys.stderr, flush=True)
        self.received = signum

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def agreed(self) -> str | None:
        """Name of the signal if any rank received one (collective when there are several ranks)."""
        if not self.enabled:
            return None
        flag = torch.tensor([float(self.received or 0)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else None


__all__ = ["ExitSignals"]
