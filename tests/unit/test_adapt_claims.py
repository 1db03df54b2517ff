"""The adaptation study's verdicts on synthetic seed means (experiments/adapt/claims.py): parity with the AR
fine-tune, the speed claim, the tau collapse per commit rule, the lever table's differences and intervals, the
design's resolution; the held-out problems (adapt_data.py)."""
import math

import pytest

from experiments.adapt import claims as C
from experiments.adapt import data as D
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


def test_held_out_problems_are_split_by_computation_and_avoid_the_corpus():
    dev, dropped = D.heldout("dev", 40, D.KNOB, 3, None)
    test, _ = D.heldout("test", 60, D.KNOB, 3, None)
    chats = D.conversations(300, D.KNOB, 3)
    keys = {c["key"] for c in chats}
    assert len(dev) == 40 and len(test) == 60 and dropped == 0
    assert not keys & {r["key"] for r in dev + test} and not {r["key"] for r in dev} & {r["key"] for r in test}
    assert D.check(chats, dev, test)["leaks"] == 0
    again, dropped = D.heldout("dev", 40, D.KNOB, 3, {dev[0]["key"], dev[5]["key"]})   # the corpus holds two
    assert dropped == 2 and again[:4] == dev[1:5] and again[4:38] == dev[6:] and len(again) == 40
    assert all(D.canonical_of(r["solution"]) == r["key"] for r in dev)        # the corpus parser finds the key
    assert D.heldout("dev", 40, D.KNOB, 3, None)[0] == dev                     # deterministic


def test_a_test_solution_in_the_training_text_is_caught():
    import copy

    from setdiff_mega.tasks import TaskError

    dev, _ = D.heldout("dev", 8, D.KNOB, 3, None)
    test, _ = D.heldout("test", 8, D.KNOB, 3, None)
    chats = copy.deepcopy(D.conversations(20, D.KNOB, 3))
    chats[4]["messages"][1]["content"] = "Some text. " + test[2]["solution"] + " more"
    with pytest.raises(TaskError, match="a test string occurs in the training data"):
        D.check(chats, dev, test)


def test_settings_are_chosen_on_dev_and_claims_read_their_own_role_on_test():
    from experiments.adapt import heldout as H

    dev = [_p("baseline", "ar", 0.80, 300, D=None), _p("baseline", "bd3lm", 0.80, 600, tau=0.9, block_size=4)]
    for tau, acc, tps in ((0.5, 0.60, 4.0), (0.7, 0.78, 3.0), (0.9, 0.81, 2.0), (1e6, 0.82, 1.0)):
        dev.append({**_p("baseline", "setdlm", acc, 0, tau=tau, window=4, D=4, rule="leftmost"),
                    "tokens_per_step": tps})
    chosen = {c["tau"]: c["roles"] for c in H.choose(dev) if c["method"] == "setdlm"}
    assert chosen == {1e6: ["best", "ar_mode"], 0.7: ["parity"], 0.9: ["at_bd3lm"]}
    test = [{**_p("baseline", "ar", 0.80, 300), "roles": "best"},
            {**_p("baseline", "bd3lm", 0.70, 600, tau=0.9), "roles": "best"},
            {**_p("baseline", "setdlm", 0.70, 900, tau=0.7, window=4), "roles": "parity"},    # misses on test
            {**_p("baseline", "setdlm", 0.79, 700, tau=0.9, window=4), "roles": "at_bd3lm"},
            {**_p("baseline", "setdlm", 0.82, 250, tau=1e6, window=4), "roles": "best+ar_mode"}]
    claims = H.test_claims(test, AdaptConfig(levers=[], recipe=None))
    parity, speed = claims
    assert not parity["holds"] and "no SetDLM setting within" in parity["value"]   # the best is not used instead
    assert speed["speedup"] == pytest.approx(700 / 600) and not speed["holds"]    # BD3LM's best, its own role
