"""The planning study's pieces on synthetic inputs (issue 56; the whole study on a toy run: tests/e2e, -m slow):
equal training FLOPs, the decoding policies, the choice on dev, the seed statistics and the verdicts."""
import math

import pytest

from experiments.planning import plan as PL
from experiments.planning import report as PR
from experiments.planning.policies import NEVER, policies
from experiments.planning.run import choose
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.decoding.config import GenerationConfig
from setdiff_mega.tasks import CHARACTERS, SEP


def test_equal_flops_gives_the_two_stream_methods_fewer_steps():
    tp = PL.default_tasks()[0]
    pc = PL.PlanningConfig(reference_steps=1000)
    tok = Tokenizer.characters(CHARACTERS, (SEP,))
    b = PL.equal_flops_steps(pc, tp, tok)
    assert set(b) == {"ar", "mdlm", "bd3lm_S4", "setdlm_D4"}
    assert b["ar"][0] == 1000
    spent = {k: steps * f for k, (steps, f) in b.items()}
    for k, v in spent.items():                       # every method spends the reference's FLOPs, to a step
        assert abs(v - spent["ar"]) <= b[k][1], k
    assert b["setdlm_D4"][0] < 0.6 * b["mdlm"][0] and b["bd3lm_S4"][0] == b["setdlm_D4"][0]


def test_policies_are_valid_generation_configs_with_the_answer_as_canvas():
    for m in PL.METHODS:
        ps = policies(m, 17)
        assert len({p["name"] for p in ps}) == len(ps)
        for p in ps:
            GenerationConfig(**p["options"]).validate()
            assert p["options"]["max_new_tokens"] == 17 and p["options"]["temperature"] == 0.0
    assert [p["options"]["commit_rule"] for p in policies({"objective": "ar"}, 5)] == ["leftmost"]
    mdlm = policies({"objective": "mdlm"}, 17)
    assert all(p["options"]["block_size"] == 17 for p in mdlm)       # one block: a global order
    assert {p["options"]["commit_rule"] for p in mdlm} == {"confidence", "leftmost"}
    assert {p["options"]["commit_k"] for p in mdlm if p["options"]["tau"] >= NEVER} == {1, 2}
    assert {p["options"]["window"] for p in policies({"objective": "setdlm", "D": 4}, 17)} == {4, 8}
    assert all(p["options"]["block_size"] == 4 for p in policies({"objective": "bd3lm", "block_size": 4}, 17))


def _pt(key, policy, acc, tps=1.0, seed=1, level=1, method=None, task="sudoku4"):
    return {"key": key, "policy": policy, "accuracy": acc, "tokens_per_step": tps, "seed": seed, "level": level,
            "method": method or key, "task": task, "n": 100}


def test_choice_on_dev_is_the_best_mean_then_the_faster():
    dev = [_pt("mdlm", "a", 0.5, seed=1), _pt("mdlm", "a", 0.7, seed=2), _pt("mdlm", "b", 0.6, seed=1),
           _pt("mdlm", "b", 0.61, seed=2), _pt("ar", "x", 0.3), _pt("setdlm", "p", 0.8, tps=1.0),
           _pt("setdlm", "q", 0.8, tps=2.5)]
    assert choose(dev) == {"mdlm": "b", "ar": "x", "setdlm": "q"}


def test_curves_and_verdicts_resolve_only_what_the_seeds_allow():
    test = []
    for seed, (s, a, m) in enumerate([(0.90, 0.20, 0.88), (0.92, 0.25, 0.80), (0.88, 0.22, 0.95)]):
        test += [_pt("setdlm_D4", "p", s, seed=seed, method="SetDLM (D=4)"), _pt("ar", "x", a, seed=seed, method="AR"),
                 _pt("mdlm", "y", m, seed=seed, method="MDLM")]
    rows = PR.curves(test)
    assert {r["method"]: r["seeds"] for r in rows} == {"SetDLM (D=4)": 3, "AR": 3, "MDLM": 3}
    v = {x["against"]: x for x in PR.verdicts(rows)}
    assert v["AR"]["verdict"] == "wins" and v["MDLM"]["verdict"] == "tie"
    sd = [r for r in rows if r["method"] == "SetDLM (D=4)"][0]["sd"]
    assert sd == pytest.approx(0.02)
    assert math.isclose(v["AR"]["difference"], 0.90 - 0.22333333, rel_tol=1e-6)
    one = PR.verdicts(PR.curves([_pt("s", "p", 0.9, method="SetDLM (D=4)"), _pt("a", "x", 0.1, method="AR")]))
    assert one[0]["verdict"] == "unresolved (one seed)"


def test_toy_config_is_small_and_complete():
    pc = PL.toy_config("/tmp/x")
    assert len(pc.methods) == 4 and pc.seeds == [1234]
    tp = pc.tasks[0]
    assert tp.levels() == [{"givens": 8}, {"givens": 6}]


def test_tokens_per_step_counts_delivered_tokens_and_commits_per_step_every_commit():
    """The measured case (converted SetDLM, 5-digit addition, W = 4): the digits come one per step, EOS and the
    padding after it are committed early; the output keeps 7 tokens of 9 commits in 6 steps."""
    from experiments.planning.evaluate import step_rates

    rows = [{"num_tokens": 7, "committed": 9, "steps": 6}, {"num_tokens": 7, "committed": 12, "steps": 6}]
    r = step_rates(rows)
    assert r["tokens_per_step"] == pytest.approx(14 / 12) and r["commits_per_step"] == pytest.approx(21 / 12)
    assert step_rates([]) == {"tokens_per_step": 0.0, "commits_per_step": 0.0}


def test_the_budget_gives_every_method_equal_flops_and_sums_to_about_six_hours():
    pc = PL.PlanningConfig()
    b = PL.budget(pc)
    assert len(b["rows"]) == len(pc.tasks) * len(pc.methods) * len(pc.seeds)
    for tp in pc.tasks:
        rows = [r for r in b["rows"] if r["task"] == tp.task and r["seed"] == pc.seeds[0]]
        plan = PL.equal_flops_steps(pc, tp, PL.task_tokenizer(), rows[0]["L"])
        flops = {k: steps * f for k, (steps, f) in plan.items()}
        ref = flops["ar"]
        assert all(abs(v / ref - 1) < 0.01 for v in flops.values())             # equal FLOPs up to rounding
    assert b["longest_s"] < 20 * 60                                              # one arm and seed in 20 minutes
    assert b["total_s"] < 7.5 * 3600
    one = PL.PlanningConfig(only=["sudoku4"], seeds=[7])
    assert len(PL.budget(one)["rows"]) == len(one.methods) and "budget:" in PL.describe(one)[-1]


def test_study_flags_are_refused_where_they_would_be_ignored(capsys, monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parents[2] / "tools"
    monkeypatch.setattr(sys, "path", [str(tools), *sys.path])
    spec = importlib.util.spec_from_file_location("reproduce_cli", tools / "reproduce.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    for argv, flag in ((["--dry-run"], "--dry-run"), (["--adapt", "--only", "x"], "--only"),
                       (["--planning", "--timings-only"], "--timings-only")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and f"{flag} applies to" in capsys.readouterr().err
    assert cli.main(["--planning", "--dry-run", "--only", "sudoku4", "--seeds", "7"]) == 0   # prints, trains nothing
    assert "budget:" in capsys.readouterr().out
