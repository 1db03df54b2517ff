"""Comparing objectives on one sweep: the compute each needs for the same validation loss, and a fit's prediction
for a run it did not see.

Compute frontier of a fit f with c FLOPs per parameter-token: L*(C) = f(N_opt(C), D_opt(C)) (:mod:`..scaling`),
decreasing in C towards E. For a target loss l > E the compute that reaches it, C(l), solves L*(C) = l; it is
found by bisection in log C (L* is monotone). The **compute multiplier** of objective X over the reference R at l
is C_X(l) / C_R(l): how many times the reference's FLOPs X needs for the same loss (> 1: X is costlier). The
targets are the reference frontier's losses at the geometric middle and at the top of the FLOPs the reference's
runs spent, so both lie inside the measured range. Interval: percentiles over pairs of bootstrap fits (the runs
of each objective resampled independently); a pair for which X's frontier never reaches l (l <= E_X) is counted
as an infinite multiplier, so the upper end may be inf. Likelihood-based losses of the diffusion objectives are
upper bounds (the any-order bound, the NELBO): their multipliers are then upper bounds too.

Prediction for a held-out run (N, D): the fit's L(N, D) with the bootstrap fits' percentile interval.
"""
from __future__ import annotations

import math

import numpy as np

from ..scaling import ScalingFit, bootstrap_fits, fit_chinchilla


def frontier_loss(fit: ScalingFit, C: float, c: float) -> float:
    return float(fit.predict(*fit.optimal(C, c)))


def compute_for_loss(fit: ScalingFit, c: float, loss: float, lo: float = 1e3, hi: float = 1e30) -> float:
    """The FLOPs at which the fit's compute frontier reaches ``loss`` (inf when it never does)."""
    if loss <= fit.E or frontier_loss(fit, hi, c) > loss:
        return math.inf
    if frontier_loss(fit, lo, c) <= loss:
        return lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(200):
        m = (a + b) / 2
        a, b = (m, b) if frontier_loss(fit, math.exp(m), c) > loss else (a, m)
    return math.exp(b)


def _arrays(rows: list[dict]):
    return (np.array([r[k] for r in rows], dtype=float) for k in ("N", "D", "val_loss"))


def _c(rows: list[dict]) -> float:
    return float(np.median([r["flops"] / (r["N"] * r["D"]) for r in rows]))


def _interval(values: list, q: tuple) -> tuple:
    """Percentiles without interpolation (an infinite multiplier stays inf, never nan); nan without values."""
    if not values:
        return math.nan, math.nan
    return float(np.percentile(values, q[0], method="lower")), float(np.percentile(values, q[1], method="higher"))


def multipliers(rows: list[dict], reference: str = "ar", n_boot: int = 200, seed: int = 0,
                level: float = 0.9) -> dict:
    """{objective: [{"loss", "flops_reference", "flops", "multiplier", "ci"}, ...]} for every objective with at
    least 5 runs other than ``reference`` (module docstring); {} without 5 reference runs."""
    by = {o: [r for r in rows if r["objective"] == o] for o in {r["objective"] for r in rows}}
    ref = by.get(reference, [])
    if len(ref) < 5:
        return {}
    c_ref, f_ref = _c(ref), fit_chinchilla(*_arrays(ref))
    flops = [r["flops"] for r in ref]
    targets = [frontier_loss(f_ref, C, c_ref) for C in (math.sqrt(min(flops) * max(flops)), max(flops))]
    boot_ref = bootstrap_fits(*_arrays(ref), n_boot=n_boot, seed=seed)
    q = ((1 - level) / 2 * 100, (1 + level) / 2 * 100)
    out = {}
    for obj, sel in sorted(by.items()):
        if obj == reference or len(sel) < 5:
            continue
        c, f = _c(sel), fit_chinchilla(*_arrays(sel))
        boot = bootstrap_fits(*_arrays(sel), n_boot=n_boot, seed=seed + 1)
        res = []
        for loss in targets:
            base, mine = compute_for_loss(f_ref, c_ref, loss), compute_for_loss(f, c, loss)
            pairs = [(compute_for_loss(a, c_ref, loss), b) for a, b in zip(boot_ref, boot)]
            ratios = [compute_for_loss(b, c, loss) / ref for ref, b in pairs if math.isfinite(ref)]
            ci = _interval(ratios, q)
            res.append({"loss": loss, "flops_reference": base, "flops": mine, "multiplier": mine / base, "ci": ci,
                        "level": level, "n_boot": len(ratios)})
        out[obj] = res
    return out


def predict(rows: list[dict], objective: str, N: float, D: float, n_boot: int = 200, seed: int = 0,
            level: float = 0.9) -> dict:
    """The fit of ``objective``'s runs at (N, D), with its bootstrap interval (module docstring)."""
    sel = [r for r in rows if r["objective"] == objective]
    if len(sel) < 5:
        raise ValueError(f"{objective}: {len(sel)} finished runs; a prediction needs a fit of at least 5")
    f = fit_chinchilla(*_arrays(sel))
    preds = [float(b.predict(N, D)) for b in bootstrap_fits(*_arrays(sel), n_boot=n_boot, seed=seed)]
    q = ((1 - level) / 2 * 100, (1 + level) / 2 * 100)
    return {"objective": objective, "N": N, "D": D, "loss": float(f.predict(N, D)),
            "ci": tuple(float(np.percentile(preds, p)) for p in q), "level": level, "n_boot": len(preds)}


__all__ = ["frontier_loss", "compute_for_loss", "multipliers", "predict"]
