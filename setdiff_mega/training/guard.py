"""Per-step policies for bad steps: non-finite losses or gradients, and loss spikes.

A step is *bad* when its loss (mean over the data-parallel group) or its global gradient norm is NaN
or inf on any rank; every rank learns the verdict through one all-reduce (MAX) of a flag over the whole
world, so TP / PP / DP ranks always agree, whichever rank produced the NaN. Then

    train.nonfinite=stop   the run stops with a TrainingError before the update (the default)
    train.nonfinite=skip   the update is discarded on every rank (gradients dropped; no optimizer step,
                           no EMA update); the batch counts as consumed, and the learning-rate schedule
                           does not advance (its position is ``step - skipped``, Megatron's choice for
                           skipped iterations); after ``train.max_skipped_steps`` bad steps in a row
                           the run stops. The number skipped is saved in ``state.json``, so a resumed
                           run continues the same schedule.

``train.spike_factor = f > 1`` logs a warning when a good step's loss exceeds f times the running mean
(an exponential mean with weight 0.95, over the good steps after the first 20).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from setdiff_mega.errors import TrainingError


def _any_rank(flag: bool) -> bool:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class StepGuard:
    WARMUP, MOMENTUM = 20, 0.95

    def __init__(self, tc, skipped: int = 0, log=print):
        self.tc, self.log = tc, log
        self.skipped, self.in_a_row, self.spikes = int(skipped), 0, 0
        self.mean, self.good = None, 0

    def schedule_step(self, step: int) -> int:
        """The learning-rate schedule's position at optimizer step ``step``."""
        return step - self.skipped

    def accept(self, step: int, loss: float, gnorm: torch.Tensor) -> bool:
        """True: apply this step's update. False: skip it (policy skip). Raises when the run must stop."""
        tc = self.tc
        if not _any_rank(not (math.isfinite(loss) and bool(torch.isfinite(gnorm)))):
            self.in_a_row = 0
            self._spike(step, loss)
            return True
        what = f"non-finite loss ({loss}) or gradient norm ({float(gnorm)}) at step {step + 1}"
        fix = (f"Lower train.lr (now {tc.lr}), keep train.clip_grad > 0, or use train.precision=fp32")
        if tc.nonfinite == "stop":
            raise TrainingError(f"{what}; no update was applied. {fix} (or train.nonfinite=skip)")
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row > tc.max_skipped_steps:
            raise TrainingError(f"{what}: {self.in_a_row} bad steps in a row exceed train.max_skipped_steps="
                                f"{tc.max_skipped_steps}; no update was applied. {fix}")
        self.log(f"warning: {what}; update skipped ({self.in_a_row} in a row, {self.skipped} in total)")
        return False

    def _spike(self, step: int, loss: float) -> None:
        f = self.tc.spike_factor
        if f and self.mean is not None and self.good >= self.WARMUP and loss > f * self.mean:
            self.spikes += 1
            self.log(f"warning: loss spike at step {step + 1}: {loss:.4f} > {f} x running mean {self.mean:.4f}")
        self.mean = loss if self.mean is None else self.MOMENTUM * self.mean + (1 - self.MOMENTUM) * loss
        self.good += 1

    def metrics(self) -> dict:
        return {"train/skipped_steps": self.skipped, "train/loss_spikes": self.spikes}


__all__ = ["StepGuard", "TrainingError"]
