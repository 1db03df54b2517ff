"""Settings chosen on dev, reported once on test (issue 55's evidence rules) for the adaptation study
(:mod:`.recipe`).

Every sampler setting of every fine-tuned model is decoded on the **dev** split (:mod:`.data`); the seed means
there (accuracy and tokens per step, both deterministic: a timing's noise never decides a choice) pick, per arm and
method, the settings the report carries to the **test** split (:func:`choose`):

    best       the most accurate setting (ties: more tokens per step)
    parity     SetDLM: the most tokens per step among the settings within PARITY_POINTS of the arm's AR fine-tune
               (none within: the best)
    at_bd3lm   SetDLM: the most tokens per step among the settings at least as accurate as the arm's BD3LM best
               (none: the best)
    ar_mode    SetDLM: the leftmost rule at tau 1e6 and W = D (its AR mode, the lever table's column)

Only those are decoded on test (and timed at batch 1), each model once per setting whatever its roles. The claims
(:func:`test_claims`) read the test means of exactly the role each claim names: parity compares the AR fine-tune
with SetDLM's ``parity`` setting, the speed claim BD3LM's ``best`` with SetDLM's ``at_bd3lm``; a setting that was
within reach on dev and misses on test fails its claim. The tau-collapse claim compares settings across tau, so it
stays on dev (the report says so).
"""
from __future__ import annotations

from setdiff_mega import methods
from setdiff_mega.diffusion.bd3lm import BD3LM
from setdiff_mega.diffusion.setdlm import SETDLM

from .claims import HIGH_TAU, PARITY_POINTS, _parity, _speed

ROLES = ("best", "parity", "at_bd3lm", "ar_mode")
SETTING = ("window", "tau", "rule")


def _most(rows: list[dict], *keys) -> dict:
    return max(rows, key=lambda p: tuple(p[k] for k in keys))


def _roles_of(sel: list[dict], rows: list[dict]) -> dict:
    """{role: dev mean} for one arm and method (``sel``) among the arm's means ``rows`` (module docstring)."""
    best = _most(sel, "accuracy", "tokens_per_step")
    out = {"best": best}
    if sel[0]["objective"] != SETDLM.name:
        return out
    ar = [p for p in rows if methods.get(p["objective"]).causal]
    if ar:
        ok = [p for p in sel if p["accuracy"] >= ar[0]["accuracy"] - PARITY_POINTS]
        out["parity"] = _most(ok, "tokens_per_step", "accuracy") if ok else best
    bd = [p for p in rows if p["objective"] == BD3LM.name]
    if bd:
        top = _most(bd, "accuracy", "tokens_per_step")["accuracy"]
        ok = [p for p in sel if p["accuracy"] >= top]
        out["at_bd3lm"] = _most(ok, "tokens_per_step", "accuracy") if ok else best
    mode = [p for p in sel if p["rule"] == "leftmost" and p["tau"] >= HIGH_TAU and p["window"] == p.get("D")]
    if mode:
        out["ar_mode"] = mode[0]
    return out


def choose(dev_means: list[dict]) -> list[dict]:
    """The settings to decode on test: one entry per (arm, method, setting) with the roles it plays."""
    out: dict = {}
    for arm in sorted({p["arm"] for p in dev_means}):
        rows = [p for p in dev_means if p["arm"] == arm]
        for method in sorted({p["method"] for p in rows}):
            for role, p in _roles_of([q for q in rows if q["method"] == method], rows).items():
                key = (arm, method, *(p[k] for k in SETTING))
                entry = out.setdefault(key, {"arm": arm, "method": method, **{k: p[k] for k in SETTING},
                                             "roles": [], "dev_accuracy": p["accuracy"]})
                entry["roles"].append(role)
    return list(out.values())


def chosen_settings(chosen: list[dict], arm: str, method: str) -> list[dict]:
    """The sampler settings (the evaluator's dicts) chosen for one model's arm and method."""
    return [{"tau": c["tau"], "commit_rule": c["rule"], **({"window": c["window"]} if c["window"] else {})}
            for c in chosen if c["arm"] == arm and c["method"] == method]


def roles_of_point(chosen: list[dict], p: dict) -> list[str]:
    return next((c["roles"] for c in chosen if (c["arm"], c["method"], *(c[k] for k in SETTING))
                 == (p["arm"], p["method"], *(p[k] for k in SETTING))), [])


def by_role(test_means: list[dict], arm: str, objective: str, role: str) -> list[dict]:
    return [p for p in test_means if p["arm"] == arm and p["objective"] == objective
            and role in (p.get("roles") or "").split("+")]


def test_claims(test_means: list[dict], ac) -> list[dict]:
    """Parity and speed per arm that trains every method, each on the test means of its own dev-chosen role."""
    from setdiff_mega.diffusion.ar import AR

    out = []
    for a in ac.arms():
        if len(a.models) < 2:
            continue
        lv = a.lever
        par = _parity(by_role(test_means, lv.name, AR.name, "best") + by_role(test_means, lv.name, SETDLM.name,
                                                                               "parity"), lv.name, lv.label)
        spd = _speed(by_role(test_means, lv.name, BD3LM.name, "best") + by_role(test_means, lv.name, SETDLM.name,
                                                                                 "at_bd3lm"), lv.name, lv.label)
        out += [c for c in (par, spd) if c]
    return out


__all__ = ["ROLES", "choose", "chosen_settings", "roles_of_point", "by_role", "test_claims"]
