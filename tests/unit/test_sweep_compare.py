"""Comparing objectives on a sweep (setdiff_mega/eval/sweep/compare.py): compute multipliers at equal loss and a
held-out prediction, on runs drawn from known scaling laws."""
import math

import numpy as np
import pytest

from setdiff_mega.eval.scaling import ScalingFit
from setdiff_mega.eval.sweep.compare import compute_for_loss, frontier_loss, multipliers, predict

LAW = ScalingFit(E=1.5, A=40.0, B=60.0, alpha=0.35, beta=0.3, loss=0.0, n_runs=0)


def _rows(objective, c, law=LAW, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for N in (2e4, 8e4, 3e5, 1e6):
        for D in (4e5, 8e5, 1.6e6):
            loss = float(law.predict(N, D)) * (1 + noise * rng.standard_normal())
            rows.append({"objective": objective, "N": N, "D": D, "flops": c * N * D, "val_loss": loss})
    return rows


def test_compute_for_loss_inverts_the_frontier():
    C = compute_for_loss(LAW, 6.0, frontier_loss(LAW, 1e15, 6.0))
    assert C == pytest.approx(1e15, rel=1e-6)
    assert compute_for_loss(LAW, 6.0, LAW.E) == math.inf              # the irreducible loss is never reached


def test_the_same_law_at_twice_the_flops_per_token_costs_twice_the_compute():
    rows = _rows("ar", 6.0) + _rows("setdlm", 12.0)
    (lo_target, hi_target) = multipliers(rows, n_boot=30)["setdlm"]
    for m in (lo_target, hi_target):
        assert m["multiplier"] == pytest.approx(2.0, rel=2e-2)
        assert m["ci"][0] <= m["multiplier"] <= m["ci"][1]
    assert lo_target["loss"] > hi_target["loss"]                       # the middle and the top of the AR runs


def test_a_worse_law_needs_more_compute_and_too_few_runs_give_nothing():
    worse = ScalingFit(E=1.6, A=40.0, B=60.0, alpha=0.35, beta=0.3, loss=0.0, n_runs=0)
    rows = _rows("ar", 6.0) + _rows("bd3lm", 6.0, law=worse)
    mid, top = multipliers(rows, n_boot=20)["bd3lm"]
    assert 1.3 < mid["multiplier"] < top["multiplier"]          # the gap widens towards the worse law's floor
    assert multipliers(_rows("ar", 6.0)[:4] + _rows("bd3lm", 6.0), n_boot=5) == {}


def test_a_held_out_prediction_comes_with_an_interval_that_holds_the_truth():
    rows = _rows("ar", 6.0, noise=0.005, seed=3)
    p = predict(rows, "ar", 3e6, 3.2e6, n_boot=30)
    truth = float(LAW.predict(3e6, 3.2e6))
    assert p["ci"][0] <= p["loss"] <= p["ci"][1] and abs(p["loss"] - truth) < 0.05
    with pytest.raises(ValueError, match="at least 5"):
        predict(rows[:3], "ar", 1e6, 1e6)


def test_the_sweep_tool_writes_compare_json_with_unreachable_losses_as_null(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("sweep_tool", root / "tools" / "sweep.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    floor = ScalingFit(E=2.9, A=40.0, B=60.0, alpha=0.35, beta=0.3, loss=0.0, n_runs=0)   # never reaches AR's top
    tool.report_multipliers(_rows("ar", 6.0) + _rows("setdlm", 12.0) + _rows("bd3lm", 6.0, law=floor), 10, tmp_path)
    got = json.loads((tmp_path / "compare.json").read_text())
    assert got["reference"] == "ar" and set(got["multipliers"]) == {"setdlm", "bd3lm"}
    assert got["multipliers"]["setdlm"][0]["multiplier"] == pytest.approx(2.0, rel=2e-2)
    assert got["multipliers"]["bd3lm"][1]["flops"] is None                  # inf -> null, valid JSON
    assert "setdlm / ar compute at equal loss: 2.0" in capsys.readouterr().out
