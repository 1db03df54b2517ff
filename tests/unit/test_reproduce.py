"""The reproduction's bookkeeping: seed aggregates, the claims check and the report section (no training)."""
import pytest

from experiments.paper import frontier as F
from experiments.paper.reproduce import ReproConfig, claims


def _pt(objective, acc, tps, tstep=1.0, **kw):
    return {"method": F.method_label({"objective": objective, **kw}), "objective": objective, "D": kw.get("D"),
            "block_size": kw.get("block_size"), "fim_rate": kw.get("fim_rate"), "window": kw.get("window"),
            "tau": kw.get("tau", 1e6), "accuracy": acc, "step_accuracy": acc, "copy_accuracy": acc, "tokens_per_s": tps,
            "tokens_per_step": tstep, "forwards": 64 / tstep, "ms_per_forward": 1e3 / tps}


def test_aggregate_means_and_spreads_over_seeds():
    rows = [{"m": "a", "x": 1.0}, {"m": "a", "x": 3.0}, {"m": "b", "x": 2.0}]
    agg = {r["m"]: r for r in F.aggregate(rows, ("m",), ("x",))}
    assert agg["a"]["x"] == 2.0 and agg["a"]["x_sd"] == pytest.approx(2 ** 0.5) and agg["a"]["seeds"] == 2
    assert agg["b"]["x_sd"] is None


def test_tags_and_labels_are_distinct_per_spec():
    specs = [{"objective": "setdlm", "D": 4, "seed": 1}, {"objective": "setdlm", "D": 4, "seed": 2},
             {"objective": "setdlm", "D": 4, "fim_rate": 0.3, "seed": 1},
             {"objective": "setdlm", "D": 4, "zero_init_head": True, "seed": 1}]
    assert len({F.method_tag(s) for s in specs}) == 4
    assert F.method_label(specs[0]) == F.method_label(specs[1]) == "SetDLM (D=4)"
    assert F.method_label(specs[2]) == "SetDLM (D=4) + FIM 0.3"
    assert F.train_overrides(specs[3]) == ["objective.name=setdlm", "objective.D=4", "model.zero_init_head=True",
                                          "train.seed=1"]


def test_default_plan_has_three_seeds_for_the_headline_rows():
    rc = ReproConfig()
    tags = [F.method_tag(m) for m in rc.models]
    for base in ("ar", "bd3lm_S4", "setdlm_D4", "setdlm_D4_fim1.0"):
        assert sum(t.startswith(base + "_s") for t in tags) == 3, base
    assert {m["objective"] for m in rc.models} == {"ar", "mdlm", "bd3lm", "setdlm"}
    assert {m.get("block_size") for m in rc.models if m["objective"] == "bd3lm"} == {4, 8}
    assert {m.get("D") for m in rc.models if m["objective"] == "setdlm"} == {2, 4, 8}
    assert any(m.get("fim_rate") for m in rc.models) and not rc.run_study
    assert {m.get("zero_init_head") for m in rc.study} == {True, False}
    scaled = ReproConfig().scaled(10)
    assert scaled.train_steps == 10 * rc.train_steps and scaled.limit == 128       # capped at the held-out set


def test_claims_hold_and_fail_on_the_seed_means():
    frontier = [_pt("ar", 0.5, 100),
                _pt("bd3lm", 0.30, 200, block_size=4, tau=0.9), _pt("bd3lm", 0.25, 400, block_size=4, tau=0.5),
                _pt("setdlm", 0.31, 500, 2.4, D=4, window=4, tau=0.9), _pt("setdlm", 0.32, 250, 1.0, D=4, window=4),
                _pt("setdlm", 0.10, 900, 3.0, D=4, window=8, tau=0.9), _pt("setdlm", 0.30, 260, 1.0, D=4, window=8)]
    infill = [{"task": "quests", "objective": o, "context": c, "exact_match": em, "fim_rate": f}
              for o, c, em, f in (("setdlm", "both sides", 0.7, 0.3), ("setdlm", "both sides", 0.1, None),
                                  ("bd3lm", "both sides", 0.45, None), ("ar", "left only", 0.1, None))]
    got = {c["claim"][:30]: c for c in claims({"frontier": frontier, "infill_means": infill})}
    holds = [c["holds"] for c in got.values()]
    assert len(holds) == 5
    assert got["AR math (arithmetic) exact mat"]["holds"]                          # 0.5 >= 0.4
    speed = got["SetDLM reaches BD3LM's best ma"]
    assert speed["holds"] and "2.50x" in speed["value"]                            # 500 / 200 tok/s
    assert "W=4, tau 0.9; 2.40 tok/step, 27 forwards of 2.00 ms" in speed["value"]   # where the time goes
    assert got["quests infill: SetDLM (best of"]["holds"]                          # FIM 0.70 - 0.45 >= 0.20
    assert got["quests infill: SetDLM beats le"]["holds"]                          # 0.70 - 0.10 >= 0.30
    assert got["SetDLM D=4 at tau 0.9: >= 2 to"]["holds"]                          # W=4: 2.4 tok/step, -1 point
    frontier[3]["accuracy"] = 0.20                                                  # now 12 points below 1e6
    got = {c["claim"][:30]: c for c in claims({"frontier": frontier, "infill_means": infill})}
    assert not got["SetDLM D=4 at tau 0.9: >= 2 to"]["holds"]
    assert "SetDLM 260 tok/s (1.30x;" in got["SetDLM reaches BD3LM's best ma"]["value"]   # 260 tok/s at 0.30
    infill[0]["exact_match"] = 0.5
    got = {c["claim"][:30]: c for c in claims({"frontier": frontier, "infill_means": infill})}
    assert not got["quests infill: SetDLM (best of"]["holds"] and got["quests infill: SetDLM beats le"]["holds"]
