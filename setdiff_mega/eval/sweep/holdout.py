"""The check that a sweep's fit extrapolates: predict the grid's held-out larger run before training it, then
train it and compare.

Order (``tools/sweep.py``, run mode): the grid's runs finish -> :func:`write_prediction` fits each objective's
runs and writes ``holdout_prediction.json`` (the loss at the held-out (N, D) with its bootstrap interval,
:func:`..compare.predict`; the number of runs it saw; the time) -> the held-out runs train -> :func:`check`
writes ``holdout.json``: predicted, interval, measured, and whether the measurement lies inside. A prediction file
that exists is never rewritten: a prediction made after its run trained would check nothing, so a re-run keeps the
first one (delete the file to predict anew, with the held-out runs' results removed too).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from setdiff_mega.training.flops import body_parameters

from .compare import predict
from .grid import SweepGrid, holdout_runs, load_run_config
from .report import collect


def _point(grid: SweepGrid) -> tuple[float, float]:
    base = load_run_config(grid)
    return float(body_parameters(dataclasses.replace(base.model, **grid.holdout["model"]))), \
        float(holdout_runs(grid)[0].tokens)


def write_prediction(grid: SweepGrid, rows: list[dict], n_boot: int = 200, log=print) -> dict | None:
    """``holdout_prediction.json`` from the grid's finished ``rows``, unless it exists (then it is returned as
    is); None without a holdout point or while an objective has fewer than 5 runs."""
    if grid.holdout is None:
        return None
    path = Path(grid.out_dir) / "holdout_prediction.json"
    if path.is_file():
        return json.loads(path.read_text())
    objectives = sorted({r.objective for r in holdout_runs(grid)})
    if any(sum(r["objective"] == o for r in rows) < 5 for o in objectives):
        log("held-out prediction: waiting until every objective has 5 finished runs")
        return None
    N, D = _point(grid)
    pred = {"N": N, "D": D, "made": time.strftime("%Y-%m-%d %H:%M:%S"), "predictions": {
        o: {**predict(rows, o, N, D, n_boot=n_boot), "runs_fitted": sum(r["objective"] == o for r in rows)}
        for o in objectives}}
    path.write_text(json.dumps(pred, indent=2))
    for o, p in pred["predictions"].items():
        log(f"held-out prediction {o} at N={N:.3g}, D={D:.3g}: loss {p['loss']:.3f} "
            f"({p['level']:.0%} interval {p['ci'][0]:.3f}-{p['ci'][1]:.3f})")
    return pred


def check(grid: SweepGrid, pred: dict, log=print) -> dict:
    """``holdout.json``: each objective's prediction against its held-out run's measured loss (None until
    trained)."""
    measured = {r["objective"]: r["val_loss"] for r in collect(grid, holdout_runs(grid))}
    out = {}
    for o, p in pred["predictions"].items():
        m = measured.get(o)
        out[o] = {"predicted": p["loss"], "ci": p["ci"], "measured": m,
                  "inside": None if m is None else bool(p["ci"][0] <= m <= p["ci"][1])}
        if m is not None:
            log(f"held-out {o}: predicted {p['loss']:.3f} ({p['ci'][0]:.3f}-{p['ci'][1]:.3f}), measured {m:.3f}"
                f" ({'inside' if out[o]['inside'] else 'OUTSIDE'} the interval)")
    (Path(grid.out_dir) / "holdout.json").write_text(json.dumps({"N": pred["N"], "D": pred["D"], **out}, indent=2))
    return out


__all__ = ["write_prediction", "check"]
