"""tools/reproduce.py end to end at toy size: every model trained once and reused, the report section written
into an existing results file (the rest kept), the CSVs and plots present. Structure only, not numbers."""
import csv
import json

import pytest
import yaml

from experiments.paper import frontier as F
from experiments.paper.reproduce import toy_config

from .conftest import _run


@pytest.mark.slow          # 2 minutes on 2 cores: seven toy trainings and their evaluations
def test_reproduce_toy_writes_report_tables_and_plots(data_dir, tmp_path):
    out, report, assets = tmp_path / "run", tmp_path / "docs" / "results.md", tmp_path / "docs" / "results" / "r"
    report.parent.mkdir()
    report.write_text("# Measured results\n\nkept above\n<!-- reproduce:begin -->\nold\n<!-- reproduce:end -->\n"
                      "kept below\n")
    args = ["tools/reproduce.py", "--toy", "--data", str(data_dir / "corpus"), "--tasks", str(data_dir / "tasks"),
            "--out", str(out), "--report", str(report), "--assets", str(assets)]
    r = _run(args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text = report.read_text()
    assert "kept above" in text and "kept below" in text and "\nold\n" not in text
    for section in ("### Claims", "### Training", "### Head study", "### Arithmetic", "### Infilling",
                    "### Likelihood", "* Command: `python tools/reproduce.py --toy", "* Commit: ", "* Machine: "):
        assert section in text, section
    assert text.count("<!-- reproduce:begin -->") == 1
    for name in ("math_points", "math_frontier", "infill", "likelihood", "training", "study", "quest_probe",
                 "claims"):
        assert list(csv.DictReader(open(assets / f"{name}.csv"))), name
    for name in ("frontier", "infill", "curves"):
        assert (assets / f"{name}.png").stat().st_size > 1000
    res = json.loads((out / "results.json").read_text())
    points = res["points"]
    assert sum(p["tag"] == "ar_s1234" for p in points) == 1                  # AR: one point
    assert sum(p["tag"] == "setdlm_D2_s1234" for p in points) == 4           # W in {D, 2D} x 2 taus
    assert {p["weights"] for p in points} == {"ema"}                         # EMA weights evaluated
    assert all(p["tokens_per_s"] > 0 and 0 <= p["accuracy"] <= 1 for p in points)
    sd = {(p["window"], p["tau"]): p["tokens_per_step"] for p in points if p["tag"] == "setdlm_D2_s1234"}
    assert sd[(2, 1e6)] == 1.0                                                # tau > 1: one token per step
    infill = {(r["task"], r["tag"], r["context"]) for r in res["infill"]}
    assert ("quests", "ar_s1234", "left only") in infill
    assert ("quests", "setdlm_D2_fim0.3_s1234", "both sides") in infill
    assert all(r["n"] > 0 for r in res["infill"])                             # every quest / story fits L
    sd_rows = {(r["task"], r["context"], r["window"]) for r in res["infill"] if r["tag"] == "setdlm_D2_s1234"}
    assert {("quests", "both sides", 4), ("quests", "both sides", 2), ("quests", "left only", 4)} <= sd_rows
    assert {r["window"] for r in res["infill"] if r["tag"] == "bd3lm_S4_s1234"} == {None}
    assert res["meta"]["engine"] == "auto" and "decoding engine `auto`" in text
    assert [c["claim"][:2] for c in res["claims"]] and all(isinstance(c["holds"], bool) for c in res["claims"])
    lik = {r["tag"]: r for r in res["likelihood"]}
    assert lik["ar_s1234"]["estimator"] == "exact" and "nll_k_orders" in lik["setdlm_D2_s1234"]
    probe = {r["tag"]: r for r in res["quest_probe"]}                      # every model that sees the suffix
    assert set(probe) == {"bd3lm_S4_s1234", "setdlm_D2_s1234", "setdlm_D2_fim0.3_s1234"}
    for r in probe.values():
        assert r["n"] > 0 and r["goal_right"] + r["goal_wrong"] + r["goal_none"] == pytest.approx(1.0)
        assert 0 <= r["first_relative"] <= 1 and 0 < r["first_confidence"] <= 1
    assert "### Quests: what a fill commits first" in text
    agg = [r for r in res["frontier"] if r["method"] == "AR"]
    assert agg[0]["seeds"] == 2 and agg[0]["accuracy_sd"] is not None        # two seeds: mean and spread
    rc = toy_config(str(out), str(data_dir / "corpus"), str(data_dir / "tasks"))     # a re-run reuses every model
    again = [F.train_model(m, rc.train_steps, out, rc.base_config, rc.overrides, log=pytest.fail) for m in rc.models]
    assert all(t["reused"] for t in again) and {t["tag"] for t in again} == {r["tag"] for r in res["training"]}


@pytest.mark.slow          # 4-5 minutes on 2 cores: the whole study at toy size (its parts: tests/unit/test_adapt_*)
def test_adaptation_recipe_toy_pretrains_exports_imports_finetunes_and_reports(data_dir, tmp_path):
    """--adapt at toy size: the Qwen3-architecture AR model is pretrained, exported in Qwen3's layout (with the
    chat template) and imported back by every fine-tune; the chat set holds no task problem and the held-out
    problems none of the chat set's; the baseline arm (AR, SetDLM, two seeds) and a lever arm (the AR parent's
    distilled answers, the next-token loss) are evaluated on chat prompts for every tau x commit rule (x W), the
    batch-1 timings agree with the batched answers; the section, CSVs and plots are written; a re-run reuses every
    model and every accuracy."""
    out, report = tmp_path / "run", tmp_path / "docs" / "results.md"
    args = ["tools/reproduce.py", "--adapt", "--toy", "--data", str(data_dir / "corpus"), "--tasks",
            str(data_dir / "tasks"), "--out", str(out), "--report", str(report)]
    r = _run(args, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text, assets = report.read_text(), report.parent / "results" / "adapt"
    for section in ("## Adapting a pretrained AR model", "### Claims", "### Test split", "### Levers",
                    "### tau against exact match", "* Problems: `arithmetic` at steps = 1, max_value = 20",
                    "### Training", "### Every setting", "* Resolution:",
                    "* Command: `python tools/reproduce.py --adapt --toy"):
        assert section in text, section
    for name in ("adapt_points", "adapt_frontier", "adapt_training", "adapt_claims", "adapt_levers", "adapt_collapse",
                 "adapt_test", "adapt_chosen"):
        assert list(csv.DictReader(open(assets / f"{name}.csv"))), name
    assert all((assets / f"adapt_{n}.png").stat().st_size > 1000 for n in ("frontier", "levers", "tau", "curves"))
    export = out / "adapt" / "qwen3_export"
    assert json.loads((export / "config.json").read_text())["model_type"] == "qwen3"
    assert "Assistant:" in json.loads((export / "tokenizer_config.json").read_text())["chat_template"]
    chats = [json.loads(x) for x in (out / "adapt" / "sft" / "arith_chat.jsonl").read_text().splitlines()]
    assert len(chats) == 40
    assert all(c["messages"][1]["content"].endswith("}$.") for c in chats)
    distilled = list((out / "adapt" / "sft").glob("distill_*.jsonl"))
    assert len(distilled) == 1 and [json.loads(x)["messages"][0] for x in distilled[0].read_text().splitlines()] \
        == [c["messages"][0] for c in chats]                           # the same prompts, the teacher's answers
    res = json.loads((out / "adapt" / "adapt.json").read_text())
    held = res["held_out"]                                             # split by computation, checked
    assert held["n"] == held["test"] == 6 and held["dev"] == 6 and held["corpus_searched"]
    assert held["check"]["leaks"] == 0 and held["check"]["keys"] == {"train": 40, "dev": 6, "test": 6}
    assert {p["arm"] for p in res["test_points"]} == {"pretrained", "baseline", "distill_ar"}
    assert all(p["split"] == "test" and p["n"] == 6 and p["agreement"] == 1.0 for p in res["test_points"])
    assert all(p["roles"] for p in res["test_points"] if p["arm"] != "pretrained")      # only dev-chosen settings
    assert {"best", "parity", "ar_mode"} <= {r for c in res["chosen"] for r in c["roles"]}
    assert {p["arm"] for p in res["points"]} == {"pretrained", "baseline", "distill_ar"}
    assert {(p["arm"], p["seed"]) for p in res["points"] if p["objective"] == "setdlm"} == {
        (a, s) for a in ("baseline", "distill_ar") for s in (1234, 7)}
    base = [p for p in res["points"] if p["arm"] == "baseline" and p["objective"] == "setdlm" and p["seed"] == 7]
    assert {(p["window"], p["tau"], p["rule"]) for p in base} == {
        (w, t, r) for w in (2, 4) for t in (0.9, 1e6) for r in ("confidence", "leftmost")}
    assert all(p["agreement"] == 1.0 and p["speed_n"] == 3 and p["n"] == 6 for p in res["points"])
    means = [r for r in res["frontier"] if r["arm"] == "baseline" and r["method"] == "AR"]
    assert means[0]["seeds"] == 2 and means[0]["accuracy_sd"] is not None
    assert {c["arm"] for c in res["claims"]} == {"baseline", "all"} and len(res["levers"]) == 2
    arm = next(d for d in (out / "adapt" / "arms").iterdir() if "distill_ar" in (d / "arms.json").read_text())
    cfg = yaml.safe_load((arm / "models" / "setdlm_D2_s1234" / "checkpoints" / "step_0000003" / "config.yaml")
                         .read_text())
    assert cfg["train"]["init_from"] == f"hf:{export}" and cfg["model"]["family"] == "qwen3"
    assert cfg["model"]["shift_logits"] is True and cfg["data"]["packing"] is True
    assert cfg["objective"]["ar_weight"] == 1.0 and "distill_" in cfg["data"]["path"]
    teacher = next(d for d in (out / "adapt" / "arms").iterdir() if "baseline" in (d / "arms.json").read_text())
    again = tmp_path / "distilled.jsonl"                                # the CLI gives the recipe's records
    r1 = _run(["tools/generate.py", "--checkpoint", str(teacher / "models" / "ar_s1234"), "--distill",
               str(out / "adapt" / "sft" / "arith_chat.jsonl"), "--out", str(again), "--max-new-tokens", "8"])
    assert r1.returncode == 0, r1.stderr[-2000:]
    assert [json.loads(x) for x in again.read_text().splitlines()] == \
        [json.loads(x) for x in distilled[0].read_text().splitlines()]
    cached = len(list(out.glob("adapt/arms/*/models/*/eval_cache/*.json")))
    r2 = _run(args, timeout=600)                                        # a re-run: nothing trained or evaluated
    assert r2.returncode == 0 and "training " not in r2.stdout and "distillation:" not in r2.stdout, r2.stdout[-2000:]
    assert len(list(out.glob("adapt/arms/*/models/*/eval_cache/*.json"))) == cached


@pytest.mark.slow          # ~5 minutes on 2 idle cores: four toy trainings and every policy's evaluation
def test_planning_study_toy_trains_every_method_chooses_on_dev_and_reports(tmp_path):
    """--planning at toy size: 4x4 Sudoku at two levels, AR / MDLM / BD3LM / SetDLM at equal FLOPs (the two-stream
    methods train fewer steps), every policy on dev, one chosen policy per method on test, batch-1 timings, the fill
    order of each method, the section, CSVs and plots; a re-run reuses every model and accuracy."""
    out, report = tmp_path / "run", tmp_path / "docs" / "results.md"
    args = ["tools/reproduce.py", "--planning", "--toy", "--out", str(out), "--report", str(report)]
    r = _run(args, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text, assets = report.read_text(), report.parent / "results" / "planning"
    for section in ("## Where set decoding should beat left to right", "### SetDLM against AR and MDLM",
                    "### Test accuracy by difficulty", "### Training (per run)", "accuracies computed at"):
        assert section in text, section
    for name in ("planning_dev", "planning_test", "planning_curves", "planning_training", "planning_verdicts"):
        assert list(csv.DictReader(open(assets / f"{name}.csv"))), name
    assert (assets / "curves_sudoku4.png").stat().st_size > 1000 and (assets / "order_sudoku4.png").is_file()
    res = json.loads((out / "planning" / "planning.json").read_text())[0]
    steps = {t["key"]: t["steps"] for t in res["training"]}
    assert steps["setdlm_D4"] < steps["ar"] and steps["bd3lm_S4"] == steps["setdlm_D4"]
    assert len({t["parameters"] for t in res["training"]}) == 1                      # one model for every method
    per_model = {}
    for p in res["test"]:
        per_model.setdefault((p["key"], p["knob"]), set()).add(p["policy"])
    assert all(len(v) == 1 for v in per_model.values()) and len(per_model) == 8    # test: the chosen policy only
    assert {p["policy"] for p in res["test"] if p["key"] == "mdlm"} == {res["chosen"]["mdlm"]}
    assert len({p["policy"] for p in res["dev"] if p["key"] == "setdlm_D4"}) == 8
    assert all(p["tokens_per_s"] > 0 for p in res["test"])
    orders = {o["method"]: o["order"] for o in res["orders"]}
    assert len(orders) == 4 and all(len(o) == 17 for o in orders.values())          # 16 cells + EOS
    assert orders["AR"][:16] == list(range(16))                                      # left to right
    again = _run(args, timeout=1500)
    assert again.returncode == 0 and "training " not in again.stdout and "drawing" not in again.stdout


@pytest.mark.slow
@pytest.mark.timeout(3000)  # ~8 minutes on 2 loaded cores: the toy parent's import, four toy fine-tunes, evaluations
def test_convert_study_toy_calibrates_trains_every_arm_and_a_rerun_without_models_reuses_every_point(tmp_path):
    """--convert at toy size: a tiny random Llama with a ChatML tokenizer imported as the parent, the calibration
    on dev, AR / BD3LM / SetDLM and the ar_weight lever fine-tuned from it, dev settings, roles, test, NLL and
    timings; the committed points let a re-run on a machine without the models train nothing."""
    import shutil

    from experiments.convert.points import code_fingerprints

    out, report, points = tmp_path / "run", tmp_path / "docs" / "results.md", tmp_path / "points"
    args = ["tools/reproduce.py", "--convert", "--toy", "--out", str(out), "--report", str(report), "--points",
            str(points)]
    r = _run(args, timeout=2400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text = report.read_text()
    for section in ("## Converting SmolLM2-135M into a SetDLM", "### Claims (test split)",
                    "### multiplication: knob digits2-digits_b2", "Calibration (AR fine-tune", "Leak check:",
                    "### Held-out NLL", "### Not run yet", "* none", "points from "):
        assert section in text, section
    count = {k: len(list((points / k).glob("*.json"))) for k in ("train", "accuracy", "nll")}
    assert count["train"] == 4 and count["nll"] == 5                       # 4 children; + the parent
    res = json.loads((out / "convert" / "convert.json").read_text())["tasks"][0]
    assert [t["knob"] for t in res["calibration"]["tried"]][:1] == ["digits2-digits_b2"]
    assert len(res["dev"]) == 1 + 1 + 2 + 2                                 # AR greedy, BD3LM tau, SetDLM W x tau
    assert {p["split"] for p in res["test"]} == {"test"} and set(res["roles"]) >= {"ar/base", "setdlm_D4/base"}
    assert res["timings"] and all(t["tokens_per_s"] > 0 for t in res["timings"])
    assets = report.parent / "results" / "convert"
    assert list(csv.DictReader(open(assets / "convert_rows.csv")))
    assert (assets / "frontier_multiplication.png").is_file()
    codes = {json.loads(f.read_text())["provenance"]["code"] for f in points.glob("*/*.json")}
    for d in ("models", "parent", "data"):                                  # a new machine: only the points are there
        shutil.rmtree(out / "convert" / d)
    again = _run([*args, "--no-timing"], timeout=1800)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert {k: len(list((points / k).glob("*.json"))) for k in count} == count
    now = set(code_fingerprints.__wrapped__().values())
    if codes <= now:                                                        # the code did not change: nothing redone
        assert "training " not in again.stdout and "importing" not in again.stdout and "drawing" not in again.stdout
    else:       # an edit of the fingerprinted code between the runs (a shared checkout): those points recomputed
        assert {json.loads(f.read_text())["provenance"]["code"] for f in points.glob("*/*.json")} <= now
