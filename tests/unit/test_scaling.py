"""The Chinchilla fit recovers known parameters from noisy synthetic losses, its bootstrap intervals cover
them, and the compute-optimal allocation is the constrained minimum."""
import numpy as np
import pytest

from setdiff_mega.eval.scaling import ScalingFit, bootstrap, fit_chinchilla

TRUE = dict(E=1.8, A=400.0, B=600.0, alpha=0.35, beta=0.30)


def _synthetic(noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    N = np.repeat(np.logspace(5.5, 8.5, 6), 5)
    D = np.tile(np.logspace(7.5, 10.5, 5), 6)
    L = TRUE["E"] + TRUE["A"] / N ** TRUE["alpha"] + TRUE["B"] / D ** TRUE["beta"]
    return N, D, L * np.exp(rng.normal(0, noise, L.size))


def test_fit_recovers_known_parameters_from_noisy_losses():
    N, D, L = _synthetic(noise=0.01)
    f = fit_chinchilla(N, D, L)
    assert f.alpha == pytest.approx(TRUE["alpha"], abs=0.03)
    assert f.beta == pytest.approx(TRUE["beta"], abs=0.03)
    assert f.E == pytest.approx(TRUE["E"], rel=0.08)
    # the fitted law predicts the noiseless losses to well within the noise level
    clean = ScalingFit(**TRUE, loss=0.0, n_runs=0).predict(N, D)
    assert np.max(np.abs(f.predict(N, D) / clean - 1)) < 0.01


def test_fit_is_exact_without_noise_and_robust_to_an_outlier():
    N, D, L = _synthetic(noise=0.0)
    f = fit_chinchilla(N, D, L)
    for k, v in TRUE.items():
        assert getattr(f, k) == pytest.approx(v, rel=2e-2), k
    L2 = L.copy()
    L2[3] *= 3.0                                  # one diverged run
    g = fit_chinchilla(N, D, L2)
    assert g.alpha == pytest.approx(TRUE["alpha"], abs=0.02) and g.beta == pytest.approx(TRUE["beta"], abs=0.02)


def test_bootstrap_intervals_cover_the_truth():
    N, D, L = _synthetic(noise=0.01, seed=1)
    ci = bootstrap(N, D, L, n_boot=40, seed=0)
    assert ci["n_boot"] >= 35
    for k in ("alpha", "beta"):
        lo, hi = ci[k]
        assert lo <= TRUE[k] <= hi and hi - lo < 0.2, (k, lo, hi)


def test_compute_optimal_allocation_minimises_loss_on_the_budget():
    f = ScalingFit(**TRUE, loss=0.0, n_runs=0)
    C, c = 1e20, 6.0
    n_opt, d_opt = f.optimal(C, c)
    assert c * n_opt * d_opt == pytest.approx(C, rel=1e-9)
    grid = np.logspace(np.log10(n_opt) - 1, np.log10(n_opt) + 1, 2001)
    best = grid[np.argmin(f.predict(grid, C / (c * grid)))]
    assert best == pytest.approx(n_opt, rel=0.01)


def test_too_few_runs_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 5 runs"):
        fit_chinchilla([1e6, 1e7], [1e8, 1e9], [3.0, 2.5])
