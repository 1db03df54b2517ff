"""Step time of data-parallel training with and without overlapped gradient reduction
(``tools/bench_grad_reduce.py``).

For each layout (PP = 1 and PP = 2, each with DP = 2) the same run (model, data, seed) trains
``steps`` optimizer steps on local gloo ranks (:func:`setdiff_mega.parallel.local.run_ranks`) once per
variant: megatron-core DDP with ``parallel.overlap_grad_reduce`` on (buckets of ``bucket_size``
elements) and off (one bucket reduced after the backward). Reported per run: the median wall time of a
step after ``warmup`` steps, measured on rank 0, and the losses (which must be equal across variants:
the reduction order changes nothing but the timing). ``ratio`` = off / on (> 1: overlap is faster).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from setdiff_mega.config import load_config
from setdiff_mega.parallel.local import run_ranks
from setdiff_mega.training import train
from setdiff_mega.training import trainer as T


def _train(rank, world, data_dir, save_dir, overrides):
    cfg = load_config(None, [f"data.path={data_dir}/corpus", f"train.save_dir={save_dir}", "train.save_interval=0",
                             "train.eval_interval=0", "train.eval_iters=1", "train.log_interval=1",
                             "logging.wandb=disabled", "logging.progress=false", "logging.jsonl=false", *overrides])
    times, step = [], T.Trainer.train_step

    def timed(self, i):
        t = time.perf_counter()
        out = step(self, i)
        times.append(time.perf_counter() - t)
        return out
    T.Trainer.train_step = timed
    try:
        res = train(cfg, log=lambda *a: None)
    finally:
        T.Trainer.train_step = step
    return times, [r["train/loss"] for r in res.history if "train/loss" in r]


def run(data_dir: Path, work: Path, model_overrides: list[str], steps: int = 8, warmup: int = 2,
        bucket_size: int = 200_000, log=print) -> list[dict]:
    """One row per (PP, variant): {pp, dp, overlap, bucket_size, median_step_s, losses}."""
    rows = []
    for pp in (1, 2):
        world = 2 * pp
        for overlap in (True, False):
            ov = [*model_overrides, f"train.train_steps={steps}", f"parallel.pipeline_model_parallel_size={pp}",
                  f"parallel.overlap_grad_reduce={str(overlap).lower()}", f"parallel.ddp_bucket_size={bucket_size}"]
            out = run_ranks(_train, world=world, args=(data_dir, work / f"pp{pp}_{overlap}", ov), timeout=1800)
            times, losses = out[0]
            med = statistics.median(times[warmup:]) if len(times) > warmup else statistics.median(times)
            rows.append({"pp": pp, "dp": 2, "overlap": overlap, "bucket_size": bucket_size, "median_step_s": med,
                         "losses": losses})
            log(f"PP={pp} DP=2 overlap={overlap}: median step {med * 1000:.0f} ms")
        on, off = rows[-2], rows[-1]
        on["ratio_off_over_on"] = off["median_step_s"] / on["median_step_s"]
        if on["losses"] != off["losses"]:
            raise RuntimeError(f"PP={pp}: the losses differ between overlapped and plain reduction "
                               f"({on['losses']} vs {off['losses']})")
        log(f"PP={pp} DP=2: off / on = {on['ratio_off_over_on']:.3f} (same losses)")
    return rows


__all__ = ["run"]
