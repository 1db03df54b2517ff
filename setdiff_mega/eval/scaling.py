"""Chinchilla scaling-law fit L(N, D) = E + A / N^alpha + B / D^beta, with bootstrap intervals.

Fitting follows Hoffmann et al. (2022, appendix D.2): with a = log A, b = log B, e = log E,

    minimise  sum_i Huber_delta( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i )

over (a, b, e, alpha, beta) with L-BFGS-B, keeping the best of several starts. The starts come from a
grid over (alpha, beta): for fixed exponents the law is linear in (E, A, B), solved by non-negative
least squares. The Huber loss (delta = 1e-3) makes the fit robust to the odd diverged run. Confidence intervals are
percentiles over fits to bootstrap resamples of the runs.

Compute-optimal allocation: a training run costs C = c N D FLOPs, where c is the objective's FLOPs
per parameter per training token measured from the runs (about 6 for AR; about 12 for SetDLM and
BD3LM, which process 2L positions per L-token sample; attention adds a little). Minimising L(N, D)
subject to c N D = C gives

    N_opt = G (C / c)^(beta / (alpha + beta)),   D_opt = (C / c)^(alpha / (alpha + beta)) / G,
    G = (alpha A / (beta B))^(1 / (alpha + beta)).

N is the non-embedding parameter count, D the number of training tokens (sample tokens, L per sample).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize, nnls

PARAMS = ("E", "A", "B", "alpha", "beta")


@dataclass
class ScalingFit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    loss: float                        # the Huber objective at the optimum
    n_runs: int

    def predict(self, N, D):
        N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
        return self.E + self.A / N ** self.alpha + self.B / D ** self.beta

    def optimal(self, C: float, c: float) -> tuple[float, float]:
        """(N_opt, D_opt) for a budget of C FLOPs at c FLOPs per parameter per token."""
        a, b = self.alpha, self.beta
        G = (a * self.A / (b * self.B)) ** (1.0 / (a + b))
        return G * (C / c) ** (b / (a + b)), (C / c) ** (a / (a + b)) / G

    def to_dict(self) -> dict:
        return asdict(self)


def _huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss and its derivative, elementwise."""
    a = np.abs(r)
    quad = a <= delta
    loss = np.where(quad, 0.5 * r * r, delta * (a - 0.5 * delta))
    grad = np.where(quad, r, delta * np.sign(r))
    return loss, grad


def _objective(theta, logN, logD, logL, delta):
    a, b, e, alpha, beta = theta
    t = np.stack([a - alpha * logN, b - beta * logD, np.full_like(logN, e)])
    m = t.max(axis=0)
    w = np.exp(t - m)
    s = w.sum(axis=0)
    lse = m + np.log(s)
    loss, g = _huber(lse - logL, delta)
    p = w / s                                   # softmax weights: d lse / d t
    grad = np.array([
        np.sum(g * p[0]), np.sum(g * p[1]), np.sum(g * p[2]),
        np.sum(g * p[0] * -logN), np.sum(g * p[1] * -logD)])
    return float(loss.sum()), grad


def _starts(N, D, L, k: int) -> list:
    """Starting points: for each (alpha, beta) on a grid, the law is linear in (E, A, B): solve it by
    non-negative least squares and keep the k best in log space."""
    cands = []
    for alpha in np.linspace(0.05, 1.5, 30):
        for beta in np.linspace(0.05, 1.5, 30):
            X = np.stack([np.ones_like(N), N ** -alpha, D ** -beta], axis=1)
            coef, _ = nnls(X / L[:, None], np.ones_like(L))           # relative residuals
            pred = X @ coef
            if np.any(pred <= 0):
                continue
            err = float(np.sum((np.log(pred) - np.log(L)) ** 2))
            cands.append((err, coef, alpha, beta))
    cands.sort(key=lambda c: c[0])
    out = []
    for _, (E, A, B), alpha, beta in cands[:k]:
        floor = 1e-6 * float(np.min(L))
        out.append(np.array([math.log(max(A, floor)), math.log(max(B, floor)), math.log(max(E, floor)), alpha, beta]))
    return out


def fit_chinchilla(N, D, L, delta: float = 1e-3, n_starts: int = 8) -> ScalingFit:
    """Fit E, A, B, alpha, beta to losses ``L`` of runs with ``N`` parameters and ``D`` tokens."""
    N, D, L = (np.asarray(x, dtype=float) for x in (N, D, L))
    if N.size < 5:
        raise ValueError(f"a 5-parameter scaling law needs at least 5 runs, got {N.size}")
    if np.any(L <= 0) or np.any(N <= 0) or np.any(D <= 0):
        raise ValueError("N, D and the losses must be positive")
    logN, logD, logL = np.log(N), np.log(D), np.log(L)
    best = None
    bounds = [(-20, 60), (-20, 60), (-20, 5), (0.01, 3.0), (0.01, 3.0)]
    for start in _starts(N, D, L, n_starts):
        res = minimize(_objective, start, args=(logN, logD, logL, delta), jac=True, method="L-BFGS-B",
                       bounds=bounds)
        if best is None or res.fun < best.fun:
            best = res
    a, b, e, alpha, beta = best.x
    return ScalingFit(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta),
                      loss=float(best.fun), n_runs=int(N.size))


def bootstrap_fits(N, D, L, n_boot: int = 200, seed: int = 0, progress=None) -> list[ScalingFit]:
    """Fits to ``n_boot`` resamples of the runs (with replacement; a resample of fewer than 5 distinct runs is
    skipped)."""
    N, D, L = (np.asarray(x, dtype=float) for x in (N, D, L))
    rng = np.random.default_rng(seed)
    fits = []
    for _ in range(n_boot):
        idx = rng.integers(0, N.size, N.size)
        if progress:
            progress(1)
        if np.unique(idx).size < 5:
            continue
        fits.append(fit_chinchilla(N[idx], D[idx], L[idx], n_starts=3))
    return fits


def bootstrap(N, D, L, n_boot: int = 200, seed: int = 0, level: float = 0.9, progress=None) -> dict:
    """Percentile intervals of every parameter over fits to resampled runs: {name: (lo, hi)}."""
    arr = np.array([[getattr(f, k) for k in PARAMS] for f in bootstrap_fits(N, D, L, n_boot, seed, progress)])
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    return {k: (float(np.percentile(arr[:, i], lo)), float(np.percentile(arr[:, i], hi)))
            for i, k in enumerate(PARAMS)} | {"n_boot": len(arr), "level": level}


__all__ = ["ScalingFit", "fit_chinchilla", "bootstrap", "bootstrap_fits"]
