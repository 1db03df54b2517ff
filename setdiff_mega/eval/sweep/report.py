"""Reporting a sweep: finished runs -> results rows (objective, N, D, FLOPs, final validation loss) ->
``results.csv``, a Chinchilla fit L(N, D) per objective with bootstrap intervals (:mod:`..scaling`) and
the compute-optimal N and D for a budget -> ``fit.json``, and the loss against FLOPs with the fitted
compute frontier -> ``scaling.png``.
"""
from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import numpy as np

from setdiff_mega.training.flops import body_parameters

from ..scaling import ScalingFit, bootstrap, fit_chinchilla
from .execute import finished
from .grid import Run, SweepGrid, flops_per_token, load_run_config


def collect(grid: SweepGrid, runs: list[Run]) -> list[dict]:
    """One row per finished run: objective, N, D, FLOPs, final validation loss."""
    base = load_run_config(grid)
    rows = []
    for r in runs:
        s = finished(grid, r)
        if s is None:
            continue
        mc = dataclasses.replace(base.model, **r.model)
        fpt = flops_per_token(grid, r.model, r.method, base)
        rows.append({"run": r.name, "objective": r.objective, "seed": r.seed, **{f"model.{k}": v for k, v in
                                                                                  r.model.items()},
                     "N": body_parameters(mc), "N_total": s.get("num_parameters"), "D": r.tokens,
                     "flops": fpt * r.tokens, "flops_per_token": fpt, "val_loss": s["final_val_loss"],
                     "steps": r.steps})
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def fit_all(rows: list[dict], budget: float | None, n_boot: int = 200) -> dict:
    """Per objective: the fit, bootstrap intervals, FLOPs per parameter-token, compute-optimal N and D."""
    out = {}
    for obj in sorted({r["objective"] for r in rows}):
        sel = [r for r in rows if r["objective"] == obj]
        if len(sel) < 5:
            out[obj] = {"error": f"{len(sel)} finished runs; a fit needs at least 5"}
            continue
        N, D, L = (np.array([r[k] for r in sel], dtype=float) for k in ("N", "D", "val_loss"))
        f = fit_chinchilla(N, D, L)
        c = float(np.median([r["flops"] / (r["N"] * r["D"]) for r in sel]))
        res = {"fit": f.to_dict(), "ci90": bootstrap(N, D, L, n_boot=n_boot), "flops_per_param_token": c,
               "runs": len(sel)}
        if budget:
            n_opt, d_opt = f.optimal(budget, c)
            res["budget_flops"] = budget
            res["optimal"] = {"N": n_opt, "D": d_opt, "tokens_per_param": d_opt / n_opt,
                              "loss": float(f.predict(n_opt, d_opt))}
        out[obj] = res
    return out


def plot(rows: list[dict], fits: dict, path: Path, title: str = "") -> Path:
    """Validation loss against training FLOPs, one colour per objective, marker size by model size, and
    the fitted compute-optimal frontier L(N_opt(C), D_opt(C))."""
    import matplotlib  # gated: the backend is chosen before pyplot is imported (headless machines)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, obj in enumerate(sorted({r["objective"] for r in rows})):
        sel = [r for r in rows if r["objective"] == obj]
        col = colours[i % len(colours)]
        sizes = np.array([r["N"] for r in sel], dtype=float)
        ax.scatter([r["flops"] for r in sel], [r["val_loss"] for r in sel], s=20 + 80 * sizes / sizes.max(),
                   color=col, alpha=0.8, label=f"{obj} runs")
        fit = fits.get(obj, {}).get("fit")
        if fit:
            f = ScalingFit(**fit)
            c = fits[obj]["flops_per_param_token"]
            lo, hi = min(r["flops"] for r in sel), max(r["flops"] for r in sel)
            C = np.logspace(math.log10(lo) - 0.3, math.log10(hi) + 0.5, 60)
            frontier = [float(f.predict(*f.optimal(x, c))) for x in C]
            ax.plot(C, frontier, color=col, lw=1.5,
                    label=f"{obj} fit: E={f.E:.2f}, alpha={f.alpha:.2f}, beta={f.beta:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["collect", "write_csv", "fit_all", "plot"]
