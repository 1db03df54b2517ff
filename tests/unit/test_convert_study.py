"""The conversion study's parts (issue 55, experiments/convert): the plan (arms, budget, the knob calibration),
the committed point store (reuse, a changed code fingerprint or config recomputes, atomic files), the leak check
on every dataset read, the choice of settings on dev and the report's claims on synthetic points."""
import json
import math
import random

import pytest

from experiments.convert import evaluate as E
from experiments.convert import plan as P
from experiments.convert import report as R
from experiments.convert import train as TR
from experiments.convert.data import load_splits
from experiments.convert.plan import ConvertConfig
from experiments.convert.points import (
    DECODE_CODE,
    KINDS,
    NLL_CODE,
    TRAIN_CODE,
    PointStore,
    code_fingerprints,
    point_key,
)
from experiments.provenance import PACKAGE
from setdiff_mega import tasks as T


def test_arms_are_named_from_the_registry_and_filtered():
    cc = P.ConvertConfig()
    names = [a.name for a in cc.arms()]
    assert names == ["ar/base", "bd3lm_S4/base", "setdlm_D4/base", "setdlm_D4/ar_weight_1", "setdlm_D4/lr_3e-4",
                     "setdlm_D4/steps_2x", "ar/steps_2x"]
    assert [a.seeds for a in cc.arms()] == [(0, 1, 2)] * 3 + [(0,)] * 4
    assert [P.kind(a.method) for a in cc.arms()] == ["causal", "block", "window"] + ["window"] * 3 + ["causal"]
    cc.only_methods, cc.only_seeds = ["setdlm_D4"], [1]
    assert [(a.name, a.seeds) for a in cc.arms()] == [("setdlm_D4/base", (1,))]   # the levers have no seed 1


def test_levers_run_on_their_tasks_with_their_steps(tmp_path):
    cc = P.ConvertConfig(out_dir=str(tmp_path))
    arms = {a.name: a for a in cc.arms()}
    arith, add = cc.tasks
    assert [a.name for a in cc.arms() if a.runs_on("arithmetic")] == ["ar/base", "bd3lm_S4/base", "setdlm_D4/base",
                                                                       "setdlm_D4/ar_weight_1"]
    assert all(a.runs_on("addition") for a in cc.arms())
    longer = arms["setdlm_D4/steps_2x"].task_plan(add)
    assert longer.steps == 2 * add.steps and arms["setdlm_D4/base"].task_plan(add) is add
    knob = add.ladder[add.start]
    # the longer fine-tune is its own run (its steps are in the run id); the AR lever is a causal child, unshifted
    assert TR.run_id(cc, arms["setdlm_D4/steps_2x"], longer, knob, "s") != TR.run_id(cc, arms["setdlm_D4/base"], add,
                                                                                     knob, "s")
    over = TR.overrides(cc, arms["ar/steps_2x"], longer, tmp_path, tmp_path, 0)
    assert "model.shift_logits=true" not in over
    lr = TR.overrides(cc, arms["setdlm_D4/lr_3e-4"], add, tmp_path, tmp_path, 0)
    assert "train.lr=3e-4" in lr and "train.min_lr=3e-5" in lr
    rows = [r for r in P.budget(cc)["rows"] if r["task"] == "addition"]
    train = {r["arm"]: r["train_s"] for r in rows}
    assert train["setdlm_D4/steps_2x"] == pytest.approx(2 * train["setdlm_D4/base"])
    assert any("2x steps; tasks addition only" in line for line in P.describe(cc))
    # the cheap task sweeps more of the frontier; the other keeps the study's taus; AR stays greedy
    assert cc.taus_of(add) == (0.1, 0.3, 0.5, 0.7, 0.9, 1e6) and cc.taus_of(arith) == cc.taus
    assert len(P.settings({"objective": "setdlm", "D": 4}, cc.taus_of(add), cc.rules)) == 12
    assert P.settings({"objective": "ar"}, cc.taus_of(add), cc.rules) == P.settings({"objective": "ar"}, cc.taus,
                                                                                     cc.rules)


def test_settings_per_method():
    taus, rules = (0.5, 0.9), ("leftmost",)
    assert P.settings({"objective": "ar"}, taus, rules) == [{"tau": 1e6, "commit_rule": "confidence"}]
    assert len(P.settings({"objective": "bd3lm", "block_size": 4}, taus, rules)) == 2
    sd = P.settings({"objective": "setdlm", "D": 4}, taus, rules)
    assert sorted({s["window"] for s in sd}) == [4, 8] and len(sd) == 4


def test_budget_states_every_arm_under_an_hour_and_the_total_near_twelve_hours():
    cc = P.ConvertConfig()
    b = P.budget(cc)
    assert len(b["rows"]) == 2 * (3 * 3 + 1) + 3         # the base arms and the ar_weight lever; 3 levers on addition
    assert all(r["total_s"] < 3600 for r in b["rows"])
    assert b["total_s"] < 12.5 * 3600 and b["total_worst_s"] < 14 * 3600      # about 12 h, + the calibration
    assert P.positions_ratio({"objective": "setdlm", "D": 4}, 256) == pytest.approx(512 / 255)
    assert P.positions_ratio({"objective": "ar"}, 128) == pytest.approx(127 / 255)
    ar = next(r for r in b["rows"] if r["arm"] == "ar/base" and r["task"] == "arithmetic")
    assert ar["train_s"] == pytest.approx(120 * P.AR_STEP_S)
    assert any("budget:" in line for line in P.describe(cc))


def _walk(tp, accuracy_of):
    tried = []
    while True:
        step = P.calibration_step(tp, tried)
        if "chosen" in step:
            return step, [t["rung"] for t in tried]
        tried.append({"rung": step["next"], "accuracy": accuracy_of[step["next"]]})


def test_calibration_moves_harder_when_too_easy_easier_when_too_hard_and_stops_in_band():
    tp = P.default_tasks()[0]                    # arithmetic: 4 rungs, starting on rung 2
    step, path = _walk(tp, {0: 0.95, 1: 0.9, 2: 0.9, 3: 0.6})
    assert path == [2, 3] and step["chosen"] == 3 and "in [0.3, 0.85]" in step["why"]
    step, path = _walk(tp, {0: 0.95, 1: 0.5, 2: 0.1, 3: 0.0})
    assert path == [2, 1] and step["chosen"] == 1


def test_calibration_between_two_rungs_or_off_the_ladder_keeps_the_nearest():
    tp = P.default_tasks()[0]
    step, path = _walk(tp, {0: 0.99, 1: 0.95, 2: 0.25, 3: 0.0})   # rung 1 too easy, rung 2 too hard (nearer)
    assert path == [2, 1] and step["chosen"] == 2 and "already tried" in step["why"]
    step, path = _walk(tp, {0: 0.99, 1: 0.88, 2: 0.1, 3: 0.0})    # now rung 1 is nearer the band
    assert path == [2, 1] and step["chosen"] == 1
    step, path = _walk(tp, {0: 0.95, 1: 0.9, 2: 0.88, 3: 0.87})   # even the hardest is too easy
    assert path == [2, 3] and step["chosen"] == 3 and "off the ladder" in step["why"]


def _store(tmp_path, code="c1", config="k1"):
    return PointStore(tmp_path / "points", code, config)


def test_point_store_reuses_matching_points_and_recomputes_on_a_new_fingerprint_or_config(tmp_path):
    key = point_key("accuracy", "setdlm_D4/base", 0, "arithmetic", "steps2", "dev", {"tau": 0.9, "window": 4}, "r1")
    calls = []

    def compute():
        calls.append(1)
        return {"accuracy": 0.5, "n": 8}

    s = _store(tmp_path)
    assert s.get(key) is None
    first = s.get_or(key, compute)
    again = s.get_or(key, compute)
    assert first["accuracy"] == again["accuracy"] == 0.5 and len(calls) == 1
    assert again["computed_at"]["code"] == "c1"
    assert _store(tmp_path, code="c2").get(key) is None                 # other code: recomputed
    assert _store(tmp_path, config="k2").get(key) is None               # other config file
    assert s.get({**key, "seed": 1}) is None                            # another key
    rec = json.loads(s.path(key).read_text())
    assert rec["key"] == key and rec["provenance"]["config"] == "k1" and "computed_at" not in rec["value"]
    _store(tmp_path, code="c2").put(key, {"accuracy": 0.75, "n": 8})    # a recomputation replaces the file
    assert s.get(key) is None and _store(tmp_path, code="c2").get(key)["accuracy"] == 0.75
    assert [f.name for f in s.path(key).parent.iterdir()] == [s.path(key).name]   # atomic: no temporary left
    with pytest.raises(ValueError, match="point kind"):
        point_key("speed", "a", 0, "t", "k")


def test_fingerprints_per_kind_a_decoding_change_invalidates_accuracies_not_trainings(tmp_path):
    train = point_key("train", "ar/base", 0, "addition", "digits4", train="r1")
    acc = point_key("accuracy", "ar/base", 0, "addition", "digits4", "dev", {"tau": 1e6}, "r1")
    old = PointStore(tmp_path / "points", {"train": "t1", "accuracy": "a1", "nll": "n1"}, "k1")
    old.put(train, {"final_val_loss": 0.5})
    old.put(acc, {"accuracy": 0.4, "n": 8})
    new_decode = PointStore(tmp_path / "points", {"train": "t1", "accuracy": "a2", "nll": "n1"}, "k1")
    assert new_decode.get(train)["final_val_loss"] == 0.5 and new_decode.get(acc) is None
    assert [r["key"]["kind"] for r in new_decode.current()] == ["train"]
    fp = code_fingerprints.__wrapped__()
    assert set(fp) == set(KINDS) and len(set(fp.values())) == 3
    for rel in (*TRAIN_CODE, *DECODE_CODE, *NLL_CODE):                   # every listed source exists
        assert (PACKAGE / rel).exists(), rel


def test_a_childs_run_directory_is_keyed_by_the_training_code(monkeypatch):
    cc = ConvertConfig(out_dir="runs/x", points="p")
    tp, arm = cc.tasks[0], cc.arms()[0]
    first = TR.run_id(cc, arm, tp, tp.ladder[0], "sha")
    monkeypatch.setattr(TR, "code_fingerprints", lambda: {"train": "other", "accuracy": "a", "nll": "n"})
    assert TR.run_id(cc, arm, tp, tp.ladder[0], "sha") != first


def test_a_truncated_point_file_is_recomputed(tmp_path):
    s = _store(tmp_path)
    key = point_key("nll", "ar/base", 0, "arithmetic", "k", "kjv")
    s.path(key).parent.mkdir(parents=True)
    s.path(key).write_text('{"key": ')
    assert s.get(key) is None
    assert s.get_or(key, lambda: {"nll_per_token": 3.2})["nll_per_token"] == 3.2


def _write_splits(d, knob):
    problems, _ = T.build_splits("multiplication", knob, 0, {"train": 40, "dev": 8, "test": 8})
    task = T.get("multiplication")
    recs = {s: [task.record(p, "chat") for p in ps] for s, ps in problems.items()}
    d.mkdir(parents=True, exist_ok=True)
    for s, rs in recs.items():
        (d / f"{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    return recs


def test_every_dataset_read_is_leak_checked(tmp_path):
    recs = _write_splits(tmp_path / "ok", {"digits": 2, "digits_b": 2})
    out = load_splits(tmp_path / "ok")
    assert out["check"]["leaks"] == 0 and len(out["dev"]) == 8
    bad = tmp_path / "bad"
    _write_splits(bad, {"digits": 2, "digits_b": 2})
    train = [*recs["train"], recs["test"][0]]                     # a test problem in the training data
    (bad / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    with pytest.raises(T.TaskError, match="both the train and the test split"):
        load_splits(bad)


def test_run_id_follows_the_recipe_and_the_parent(tmp_path):
    cc = P.ConvertConfig(out_dir=str(tmp_path))
    base, lever = cc.arms()[2], cc.arms()[3]
    tp, knob = cc.tasks[0], cc.tasks[0].ladder[2]
    a = TR.run_id(cc, base, tp, knob, "sha")
    assert a == TR.run_id(cc, base, tp, knob, "sha")
    assert a != TR.run_id(cc, lever, tp, knob, "sha") and a != TR.run_id(cc, base, tp, knob, "other")
    over = TR.overrides(cc, lever, tp, tmp_path / "d", tmp_path / "parent", 1)
    assert "model.shift_logits=true" in over and "objective.ar_weight=1.0" in over and "data.seed=1" in over
    assert "model.shift_logits=true" not in TR.overrides(cc, cc.arms()[0], tp, tmp_path, tmp_path, 0)
    d = TR.child_dir(cc, base, tp, knob, 2, "sha")
    assert d.name == "setdlm_D4_s2" and not TR.trained(d, tp.steps)


def _dev(arm, kind, setting, acc, tps, seeds=(0, 1, 2), recipe="base"):
    return [{"task": "t", "arm": arm, "method": arm, "kind": kind, "recipe": recipe, "seed": s, "setting": setting,
             "accuracy": acc, "tokens_per_step": tps} for s in seeds]


def test_roles_are_chosen_on_dev_means():
    g = {"tau": 1e6, "commit_rule": "confidence"}
    slow, fast, faster = ({"window": 4, "tau": t, "commit_rule": "leftmost"} for t in (1e6, 0.9, 0.5))
    b9, b5 = ({"tau": t, "commit_rule": "leftmost"} for t in (0.9, 0.5))
    dev = [*_dev("ar/base", "causal", g, 0.60, 1.0),
           *_dev("bd3lm_S4/base", "block", b9, 0.50, 1.5), *_dev("bd3lm_S4/base", "block", b5, 0.40, 2.5),
           *_dev("setdlm_D4/base", "window", slow, 0.62, 1.0), *_dev("setdlm_D4/base", "window", fast, 0.58, 2.0),
           *_dev("setdlm_D4/base", "window", faster, 0.48, 3.5),
           *_dev("setdlm_D4/x", "window", fast, 0.1, 2.0, seeds=(0,), recipe="x")]
    r = E.roles(dev)
    assert r[("t", "ar/base")] == {"best": g}
    assert r[("t", "bd3lm_S4/base")] == {"best": b9}                      # nothing within 3 points of AR
    assert r[("t", "setdlm_D4/base")] == {"best": slow, "parity_ar": fast, "parity_bd3lm": faster}
    assert r[("t", "setdlm_D4/x")] == {"best": fast}                       # the lever: nothing reaches either
    assert E.chosen_settings(r[("t", "setdlm_D4/base")]) == [slow, fast, faster]


def _row(arm, kind, roles, acc, sd, tps, recipe="base"):
    return {"task": "t", "arm": arm, "kind": kind, "recipe": recipe, "roles": roles, "setting": roles, "seeds": 3,
            "accuracy": acc, "sd": sd, "n": 512, "tokens_per_step": 1.0, "tokens_per_s": tps}


def test_claims_hold_miss_or_wait_for_their_points():
    rows = [_row("ar/base", "causal", "best", 0.60, 0.01, 10.0),
            _row("bd3lm_S4/base", "block", "best", 0.50, 0.02, 8.0),
            _row("setdlm_D4/base", "window", "parity_ar", 0.58, 0.02, 25.0),
            _row("setdlm_D4/base", "window", "parity_bd3lm", 0.49, 0.03, 11.0)]
    parity, speed = R.claims(rows, "t")
    assert parity["status"] == "holds" and parity["speed_ratio"] == pytest.approx(2.5)
    assert parity["difference"] == pytest.approx(-0.02)
    assert speed["status"] == "missed" and speed["speed_ratio"] == pytest.approx(11 / 8)   # < 1.5x
    seed_res = 2 * math.sqrt((0.02 ** 2 + 0.01 ** 2) / 2) / math.sqrt(3)
    assert parity["resolvable"] == pytest.approx(max(seed_res, math.sqrt(0.59 * 0.41 / 512)))
    rows[2]["tokens_per_s"] = None
    assert R.claims(rows, "t")[0]["status"] == "not run yet (timings)"
    assert [c["status"] for c in R.claims(rows[:1], "t")] == ["not run yet", "not run yet"]
    rows[2]["tokens_per_s"], rows[2]["accuracy"] = 25.0, 0.55                         # 5 points below AR
    assert R.claims(rows, "t")[0]["status"] == "missed"
    rows[2]["accuracy"], rows[2]["seeds"] = 0.6, 1
    assert R.claims(rows, "t")[0]["status"] == "holds (1 seed of 3)"
    rows[0]["accuracy"] = rows[2]["accuracy"] = 0.99                                  # a saturated task
    assert R.claims(rows, "t")[0]["status"].startswith("not applicable (AR test exact match 0.990 outside")


def test_a_claim_no_dev_setting_reached_is_missed_on_the_best_row_not_left_waiting():
    rows = [_row("ar/base", "causal", "best", 0.78, 0.01, None),
            _row("bd3lm_S4/base", "block", "best", 0.43, 0.05, None),
            _row("setdlm_D4/base", "window", "best", 0.62, 0.07, None),
            _row("setdlm_D4/base", "window", "parity_bd3lm", 0.61, 0.08, None)]
    roles = {"ar/base": {"best": "best"}, "bd3lm_S4/base": {"best": "best"},
             "setdlm_D4/base": {"best": "best", "parity_bd3lm": "parity_bd3lm"}}
    parity, speed = R.claims(rows, "t", roles=roles)
    assert parity["status"].startswith("missed (no setting within 3 points on dev")          # before any timing
    assert parity["setdlm"] == 0.62 and parity["difference"] == pytest.approx(-0.16)
    assert speed["status"] == "not run yet (timings)"
    roles["setdlm_D4/base"]["parity_ar"] = "parity_ar"          # chosen on dev, its test point not decoded yet
    assert R.claims(rows, "t", roles=roles)[0]["status"] == "not run yet"
    assert R.claims(rows, "t")[0]["status"] == "not run yet"    # without the roles nothing is concluded


def test_levers_are_compared_with_their_base_on_the_same_seed_at_their_best_dev_setting():
    def pt(arm, kind, recipe, seed, setting, acc):
        return {"task": "t", "arm": arm, "kind": kind, "recipe": recipe, "seed": seed, "setting": setting,
                "accuracy": acc, "tokens_per_step": 1.5}
    w4, w8 = ({"window": w, "tau": 0.9, "commit_rule": "leftmost"} for w in (4, 8))
    test = [pt("setdlm_D4/base", "window", "base", s, w4, a) for s, a in ((0, 0.60), (1, 0.70), (2, 0.80))]
    test += [pt("setdlm_D4/base", "window", "base", 0, w8, 0.10),          # another role's setting: not compared
             pt("setdlm_D4/lr", "window", "lr", 0, w8, 0.66), pt("ar/steps_2x", "causal", "steps_2x", 0, {}, 0.9)]
    roles = {"setdlm_D4/base": {"best": E.setting_name(w4), "parity_ar": E.setting_name(w8)},
             "setdlm_D4/lr": {"best": E.setting_name(w8)}, "ar/steps_2x": {"best": "greedy"}}
    test[-1]["setting"] = {"tau": 1e6, "commit_rule": "confidence"}
    rows = [_row("ar/base", "causal", "best", 0.75, 0.01, None)]
    out = {x["arm"]: x for x in R.lever_rows({"task": "t", "test": test, "roles": roles}, rows)}
    assert set(out) == {"setdlm_D4/lr", "ar/steps_2x"}
    lr = out["setdlm_D4/lr"]
    assert lr["base_accuracy"] == 0.60 and lr["vs_base"] == pytest.approx(0.06) and lr["vs_ar"] == pytest.approx(-0.09)
    assert out["ar/steps_2x"]["base_accuracy"] is None and out["ar/steps_2x"]["vs_ar"] == pytest.approx(0.15)


def test_the_report_lists_missing_points_and_keeps_the_rest_of_the_file(tmp_path):
    rng = random.Random(0)
    test = [{"task": "t", "knob": "k", "arm": "ar/base", "method": "AR", "kind": "causal", "recipe": "base", "seed": s,
             "split": "test", "setting": {"tau": 1e6, "commit_rule": "confidence"}, "accuracy": rng.random(),
             "n": 512, "tokens_per_step": 1.0, "computed_at": {"commit": "abc", "code": "c1"}} for s in (0, 1, 2)]
    name = E.setting_name(test[0]["setting"])
    cal = {"why": "in band", "tried": [{"rung": 0, "knob": "k", "accuracy": 0.5}]}
    res = {"tasks": [{"task": "t", "knob": "k", "calibration": cal, "train": [], "dev": [], "test": test, "nll": [],
                      "timings": [], "roles": {"ar/base": {"best": name}}}],
           "missing": [{"task": "t", "arm": "setdlm_D4/base", "point": "accuracy", "split": "dev", "seed": 1}],
           "parent": "p.gguf", "parent_sha": "f" * 64, "budget": P.budget(P.ConvertConfig())}
    assets = R.write_assets(res, tmp_path / "assets")
    assert (tmp_path / "assets" / "convert_rows.csv").is_file() and (tmp_path / "assets" / "frontier_t.png").is_file()
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nhand-written analysis\n")
    R.write_report(res, assets, "python tools/reproduce.py --convert", 1.0, doc, "assets")
    R.write_report(res, assets, "python tools/reproduce.py --convert", 1.0, doc, "assets")
    text = doc.read_text()
    assert text.count(R.BEGIN) == 1 and "hand-written analysis" in text
    assert "setdlm_D4/base: accuracy (dev), seeds 1: not run yet" in text
    assert "abc (code c1): 3 points" in text and "**not run yet**" in text


def test_a_run_that_may_compute_nothing_lists_every_missing_point_and_touches_nothing(tmp_path):
    from experiments.convert import run as RUN

    parent = tmp_path / "parent.gguf"
    parent.write_bytes(b"not read: only hashed")
    cc = P.ConvertConfig(out_dir=str(tmp_path / "out"), parent=str(parent), points=str(tmp_path / "points"))
    cc.tasks = cc.tasks[:1]
    res = RUN.run(cc, compute=False, timings=False, log=lambda *a: None)
    assert res["tasks"][0]["knob"] is None and res["tasks"][0]["calibration"]["why"] == "calibration not run yet"
    assert [(m["arm"], m["point"], m["split"]) for m in res["missing"]] == [("ar/base", "accuracy", "dev")]
    ctx = RUN.Context(cc, RUN.store_of(cc), parent_sha=res["parent_sha"])     # the calibration's point, stored
    tp = cc.tasks[0]
    ar = RUN.Child(ctx, cc.arms()[0], tp, tp.ladder[tp.start], 0, False)
    ctx.store.put(ar._key("accuracy", "dev", P.settings({"objective": "ar"}, cc.taus, cc.rules)[0]),
                  {"accuracy": 0.5, "n": 256, "tokens_per_step": 1.0, "correct": ""})
    res = RUN.run(cc, compute=False, timings=False, log=lambda *a: None)
    t = res["tasks"][0]
    assert t["knob"] == "steps2-max_value50" and t["calibration"]["tried"][0]["accuracy"] == 0.5
    assert [p["arm"] for p in t["dev"]] == ["ar/base"]
    kinds = [(m["arm"], m["point"]) for m in res["missing"]]
    # AR: dev of seeds 1 and 2, and test of every seed (its role is chosen on the one dev mean there is)
    assert kinds.count(("ar/base", "accuracy")) == 2 + 3 and kinds.count(("setdlm_D4/base", "accuracy")) == 3 * 8
    assert kinds.count(("parent", "nll")) == 1 and kinds.count(("setdlm_D4/ar_weight_1", "train")) == 1
    assert len(kinds) == 11 + 18 + 30 + 10 + 2
    assert not (tmp_path / "out").exists()                                  # no import, no data, no model


def _child_setup(tmp_path, monkeypatch, train_child):
    """A study context whose data preparation and parent tokenizer are stubbed and whose ``train_child`` is given:
    (run module, context, the first arm's child maker for a seed)."""
    from experiments.convert import run as RUN

    parent = tmp_path / "parent.gguf"
    parent.write_bytes(b"not read: only hashed")
    cc = P.ConvertConfig(out_dir=str(tmp_path / "out"), parent=str(parent), points=str(tmp_path / "points"))
    ctx = RUN.Context(cc, RUN.store_of(cc), parent=parent, parent_sha="p" * 8)
    monkeypatch.setattr(RUN.D, "prepare", lambda *a: tmp_path / "data")
    monkeypatch.setattr(RUN.TR, "parent_tokenizer", lambda p: None)
    monkeypatch.setattr(RUN.TR, "train_child", train_child)
    tp = cc.tasks[0]
    return ctx, lambda seed: RUN.Child(ctx, cc.arms()[0], tp, tp.ladder[tp.start], seed, True)


def test_a_model_trained_before_keeps_its_training_point_and_commit(tmp_path, monkeypatch):
    """Loading a child's model again (to decode a new setting) must not re-stamp its training point with the commit
    of the decoding run: the point names the commit it was trained at; a child without a point gets one."""
    ctx, child_of = _child_setup(tmp_path, monkeypatch,
                                 lambda *a: {"value": {"val_loss": 0.5}, "dir": str(tmp_path / "run")})
    child = child_of(0)
    stored = {"key": child._key("train"), "value": {"val_loss": 0.5},
              "provenance": {"code": ctx.store.code_of("train"), "commit": "abc1234", "config": ctx.store.config}}
    path = ctx.store.path(child._key("train"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(stored))
    assert child.model() == tmp_path / "run"
    assert json.loads(path.read_text())["provenance"]["commit"] == "abc1234"
    path.unlink()
    child_of(1).model()
    assert ctx.store.get(child_of(1)._key("train"))["val_loss"] == 0.5     # a new training: its point is stored


def test_a_failed_child_training_is_one_line_that_says_how_to_resume(tmp_path, monkeypatch):
    from setdiff_mega.errors import TrainingError

    def killed(*a):
        raise RuntimeError("training ar_s1 failed (exit -9); see runs/x/train.log")
    _, child_of = _child_setup(tmp_path, monkeypatch, killed)
    with pytest.raises(TrainingError, match=r"exit -9\); see runs/x/train.log; the same command again resumes"):
        child_of(0).model()
