"""The adaptation study's verdicts on synthetic seed means (experiments/adapt/claims.py): parity with the AR
fine-tune, the speed claim, the tau collapse per commit rule, the lever table's differences and intervals, the
design's resolution; the held-out problems (adapt_data.py)."""
import math

import pytest

from experiments.adapt import claims as C
from experiments.adapt.data import eval_problems
from experiments.adapt.evaluate import resolution, settings, t95
from experiments.adapt.levers import Lever
from experiments.adapt.recipe import AdaptConfig


def _p(arm, objective, acc, tps, tau=1e6, rule="confidence", window=None, sd=0.02, seeds=3, **kw):
    return {"arm": arm, "lever": arm, "method": objective, "objective": objective, "window": window, "tau": tau,
            "rule": rule, "accuracy": acc, "accuracy_sd": sd, "tokens_per_s": tps, "tokens_per_step": 2.0,
            "forwards": 100.0, "ms_per_forward": 4.0, "seeds": seeds, "n": 512, "step_accuracy": acc, **kw}


def _config():
    return AdaptConfig(levers=[Lever("lever_a", "lever a", "test", ("objective.ar_weight=1",))],
                       recipe=Lever("recipe", "recipe", "test", steps=900))


def _means():
    rows = [_p("baseline", "ar", 0.90, 300), _p("baseline", "bd3lm", 0.60, 600, tau=0.9, block_size=4),
            _p("recipe", "ar", 0.99, 300), _p("recipe", "bd3lm", 0.99, 500, tau=0.9, block_size=4)]
    for arm, acc in (("baseline", 0.55), ("lever_a", 0.70), ("recipe", 0.985)):
        for rule in ("confidence", "leftmost"):
            for tau, tps in ((0.5, 700), (1e6, 250)):
                low = acc if rule == "leftmost" or arm == "recipe" else acc - 0.3     # the collapse at tau 1e6
                fast = tps + (10 if rule == "leftmost" else 0)
                rows.append(_p(arm, "setdlm", low if tau > 1 else acc, fast, tau, rule, window=4, D=4))
    return rows


def test_parity_speed_and_collapse_claims():
    claims = C.claims(_means(), _config())
    kind = {(c["arm"], "parity" if "AR fine-tune" in c["claim"] else "speed" if "BD3LM" in c["claim"] else "rule"): c
            for c in claims if c["arm"] != "all"}
    base = kind[("baseline", "parity")]
    assert not base["holds"] and "no SetDLM setting within 0.03" in base["value"] and "0.350 below" in base["value"]
    assert kind[("baseline", "speed")]["speedup"] is None and "no SetDLM setting reaches it" in \
        kind[("baseline", "speed")]["value"]                                     # 0.55 < BD3LM's 0.60
    rec = kind[("recipe", "parity")]
    assert rec["holds"] and rec["speedup"] == pytest.approx(710 / 300)           # 0.985 >= 0.99 - 0.03 at 710 tok/s
    speed = kind[("recipe", "speed")]
    assert not speed["holds"] and speed["speedup"] is None                       # 0.985 < BD3LM's 0.99
    rules = {c["claim"].split("'")[1]: c for c in claims if c["arm"] == "all"}
    assert not rules["confidence"]["holds"] and "+0.300" in rules["confidence"]["value"]
    assert rules["leftmost"]["holds"]


def _seed_points():
    """Per-seed exact match at the best settings (leftmost, tau 0.5, W = 4): seed 42 lucky in both arms."""
    out = []
    for arm, accs in (("baseline", (0.45, 0.50, 0.70)), ("lever_a", (0.60, 0.66, 0.84))):
        for seed, acc in zip((1234, 7, 42), accs):
            out.append({"arm": arm, "objective": "setdlm", "D": 4, "window": 4, "tau": 0.5, "rule": "leftmost",
                        "seed": seed, "accuracy": acc, "n": 512})
    return out


def test_lever_rows_differences_and_intervals():
    rows = {r["arm"]: r for r in C.lever_rows(_means(), _seed_points(), _config())}
    assert set(rows) == {"baseline", "lever_a", "recipe"}
    a = rows["lever_a"]
    assert a["delta"] == pytest.approx(0.15) and a["best"] == 0.70
    assert a["delta_welch_95"] == pytest.approx(t95(4) * math.sqrt(2 * 0.02 ** 2 / 3))
    diffs = [0.15, 0.16, 0.14]                                   # paired: the seeds' luck cancels
    assert a["delta_95"] == pytest.approx(t95(2) * 0.01 / math.sqrt(3))
    assert C.paired({1: 0.6, 2: 0.66, 3: 0.84}, {1: 0.45, 2: 0.5, 3: 0.7})[0] == pytest.approx(sum(diffs) / 3)
    assert a["ar_mode"] == 0.70 and a["near_ar_speedup"] is None                 # 0.70 < 0.90 - 0.03
    assert rows["recipe"]["near_ar_speedup"] == pytest.approx(710 / 300)


def test_resolution_and_design():
    r = resolution(512, 3, 0.8, 0.05)
    assert r["binomial_se"] == pytest.approx(math.sqrt(0.16 / 512))
    assert r["difference_95"] == pytest.approx(2.776445 * math.sqrt(2 * 0.0025 / 3), rel=1e-4)
    d = C.design_resolution(_means(), _seed_points(), _config())
    assert d["n"] == 512 and d["seeds"] == 3 and d["pooled_seed_sd"] == pytest.approx(0.02)
    assert d["pooled_pair_sd"] == pytest.approx(0.01) and d["paired_difference_95"] == pytest.approx(
        t95(2) * 0.01 / math.sqrt(3))


def test_settings_per_method():
    assert settings({"objective": "ar"}, [0.5, 1e6]) == [{"tau": 1e6, "commit_rule": "confidence"}]
    assert len(settings({"objective": "bd3lm", "block_size": 4}, [0.5, 0.9, 1e6])) == 6
    s = settings({"objective": "setdlm", "D": 4}, [0.5, 1e6], windows=(1, 2))
    assert {x["window"] for x in s} == {4, 8} and len(s) == 8


def test_held_out_problems_avoid_the_training_questions_and_repeat_none():
    task = [{"question": f"q{i}", "answer": str(i)} for i in range(5)]
    rows = eval_problems(40, 3, task, exclude={"q1"})
    assert len(rows) == 40 and len({r["question"] for r in rows}) == 40
    assert [r["question"] for r in rows[:4]] == ["q0", "q2", "q3", "q4"] and "q1" not in {r["question"] for r in rows}
    assert eval_problems(40, 3, task, exclude={"q1"}) == rows                  # deterministic
