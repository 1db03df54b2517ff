"""The adaptation study's verdicts (:mod:`.adapt`), all on seed means of one held-out set:

* **parity** (per arm that fine-tunes AR and SetDLM alike: the baseline and the recommended recipe): the fastest
  SetDLM setting whose exact match is within ``PARITY_POINTS`` of the arm's AR fine-tune, and its tokens/s over
  AR's at batch 1 (the claim: >= ``PARITY_SPEEDUP``); without such a setting, the most accurate one and its gap;
* **speed** (per arm with BD3LM and SetDLM): the paper's claim, SetDLM at BD3LM's best exact match at >= 1.5x its
  tokens/s (:func:`.frontier.summarise`);
* **collapse**: per arm, SetDLM window and commit rule, exact match at the lowest tau minus at tau 1e6; under
  the AR-anchored rule ("leftmost") no gap may exceed ``COLLAPSE_POINTS``;
* **levers** (:func:`lever_rows`): per arm, the lever model's most accurate setting against the baseline's: the
  difference of the means and its 95% interval from the per-seed differences (:func:`paired`: every arm trains
  with the same seeds, i.e. the same noise draws and data order, so a lucky seed is lucky in both; t at k - 1
  degrees of freedom; the unpaired Welch interval is kept in the CSV), its AR mode (the leftmost rule at tau
  1e6) and the fastest setting within ``PARITY_POINTS`` of the baseline AR fine-tune;
* **resolution** (:func:`design_resolution`): the binomial standard error of one seed, the smallest difference
  of two arms' means the seeds resolve unpaired (:func:`.adapt_eval.resolution`, at the pooled seed sd of the
  SetDLM arms' best settings) and paired (at the pooled sd of the levers' per-seed differences).
"""
from __future__ import annotations

import math
import statistics

from experiments.paper import frontier as F
from setdiff_mega import methods
from setdiff_mega.diffusion.ar import AR
from setdiff_mega.diffusion.setdlm import SETDLM

from .evaluate import resolution, t95

PARITY_POINTS, PARITY_SPEEDUP, COLLAPSE_POINTS, HIGH_TAU = 0.03, 2.0, 0.10, 100.0


def _setting(p: dict) -> str:
    tau = "1e6" if p["tau"] >= HIGH_TAU else f"{p['tau']:g}"
    return (f"W={p['window']}, " if p.get("window") else "") + f"tau {tau}" + (
        f", {p['rule']}" if p.get("rule") and not methods.get(p["objective"]).causal else "")


def _best(rows: list[dict]) -> dict:
    return max(rows, key=lambda p: (p["accuracy"], p["tokens_per_s"]))


def _of(means: list[dict], arm: str, objective: str) -> list[dict]:
    return [p for p in means if p["arm"] == arm and p["objective"] == objective]


def _parity(means: list[dict], arm: str, label: str) -> dict | None:
    ar, sd = _of(means, arm, AR.name), _of(means, arm, SETDLM.name)
    if not ar or not sd:
        return None
    a = ar[0]
    ok = [p for p in sd if p["accuracy"] >= a["accuracy"] - PARITY_POINTS]
    if ok:
        f = max(ok, key=lambda p: p["tokens_per_s"])
        sp = f["tokens_per_s"] / a["tokens_per_s"]
        value = (f"AR {a['accuracy']:.3f} at {a['tokens_per_s']:.0f} tok/s; SetDLM {f['accuracy']:.3f} at "
                 f"{f['tokens_per_s']:.0f} tok/s ({sp:.2f}x; {_setting(f)}; {f['tokens_per_step']:.2f} tok/step, "
                 f"{f['forwards']:.0f} forwards of {f['ms_per_forward']:.2f} ms)")
    else:
        b = _best(sd)
        sp = None
        value = (f"AR {a['accuracy']:.3f} at {a['tokens_per_s']:.0f} tok/s; no SetDLM setting within "
                 f"{PARITY_POINTS:.2f}: best {b['accuracy']:.3f} ({_setting(b)}, {b['tokens_per_s']:.0f} tok/s, "
                 f"{b['tokens_per_s'] / a['tokens_per_s']:.2f}x), {a['accuracy'] - b['accuracy']:.3f} below")
    return {"claim": f"{label}: SetDLM within {PARITY_POINTS * 100:.0f} points of the AR fine-tune at >= "
                     f"{PARITY_SPEEDUP:g}x its tokens/s", "value": value, "holds": bool(sp and sp >= PARITY_SPEEDUP),
            "arm": arm, "speedup": sp}


def _speed(means: list[dict], arm: str, label: str) -> dict | None:
    s = F.summarise([p for p in means if p["arm"] == arm]).get("accuracy")
    if not s:
        return None
    b, f, sp = s["bd3lm_best"], s["setdlm_fastest_at_least_as_accurate"], s["speedup"]
    found = (f"SetDLM {f['accuracy']:.3f} at {f['tokens_per_s']:.0f} tok/s ({sp:.2f}x; W={f['window']}, tau "
             f"{f['tau']:g}; {f['tokens_per_step']:.2f} tok/step, {f['forwards']:.0f} forwards of "
             f"{f['ms_per_forward']:.2f} ms)") if f else "no SetDLM setting reaches it"
    return {"claim": f"{label}: SetDLM reaches BD3LM's best exact match at >= 1.5x its tokens/s",
            "value": f"BD3LM best {b['accuracy']:.3f} (tau {b['tau']:g}) at {b['tokens_per_s']:.0f} tok/s "
                     f"({b['tokens_per_step']:.2f} tok/step, {b['forwards']:.0f} forwards of "
                     f"{b['ms_per_forward']:.2f} ms); {found}", "holds": bool(sp and sp >= 1.5), "arm": arm,
            "speedup": sp}


def collapse_rows(means: list[dict]) -> list[dict]:
    """Per arm, SetDLM window and rule: exact match at the lowest tau and at tau 1e6, and the gap."""
    out = []
    groups: dict = {}
    for p in means:
        if p["objective"] == SETDLM.name:
            groups.setdefault((p["arm"], p["lever"], p["window"], p["rule"]), []).append(p)
    for (arm, lever, w, rule), ps in groups.items():
        lo, hi = min(ps, key=lambda p: p["tau"]), max(ps, key=lambda p: p["tau"])
        if hi["tau"] < HIGH_TAU or lo is hi:
            continue
        out.append({"arm": arm, "lever": lever, "window": w, "rule": rule, "low_tau": lo["tau"],
                    "accuracy_low": lo["accuracy"], "accuracy_1e6": hi["accuracy"],
                    "gap": lo["accuracy"] - hi["accuracy"]})
    return out


def claims(means: list[dict], ac) -> list[dict]:
    arms = [a.lever for a in ac.arms() if len(a.models) > 1]
    out = [c for lv in arms for c in (_parity(means, lv.name, lv.label), _speed(means, lv.name, lv.label)) if c]
    col = collapse_rows(means)
    for rule in ac.rules:
        rows = [r for r in col if r["rule"] == rule]
        if rows:
            worst = max(rows, key=lambda r: abs(r["gap"]))
            out.append({"claim": f"commit rule '{rule}': no SetDLM setting loses more than "
                                 f"{COLLAPSE_POINTS * 100:.0f} points between tau {worst['low_tau']:g} and 1e6",
                        "value": f"largest gap {worst['gap']:+.3f} ({worst['lever']}, W={worst['window']}: "
                                 f"{worst['accuracy_low']:.3f} vs {worst['accuracy_1e6']:.3f}) over {len(rows)} "
                                 f"arm x window pairs", "holds": abs(worst["gap"]) <= COLLAPSE_POINTS,
                        "arm": "all", "speedup": None})
    return out


def _diff(a: dict, b: dict) -> tuple[float, float | None]:
    """(a - b, 95% half-width) of two seed means (Welch, t at 2 (k - 1) degrees of freedom)."""
    d = a["accuracy"] - b["accuracy"]
    if not a.get("accuracy_sd") or not b.get("accuracy_sd"):
        return d, None
    k = min(a["seeds"], b["seeds"])
    return d, t95(2 * (k - 1)) * math.sqrt(a["accuracy_sd"] ** 2 / a["seeds"] + b["accuracy_sd"] ** 2 / b["seeds"])


def _seeds_at(points: list[dict], at: dict) -> dict:
    """{seed: exact match} of the points of ``at``'s arm, model and setting."""
    key = ("arm", "objective", "D", "block_size", "window", "tau", "rule")
    return {p["seed"]: p["accuracy"] for p in points if all(p.get(k) == at.get(k) for k in key)}


def paired(a: dict, b: dict) -> tuple[float | None, float | None, int]:
    """(mean, 95% half-width (t at k - 1), k) of the per-seed differences a[s] - b[s] over the common seeds: the
    arms share their seeds (the same ``train.seed`` and ``data.seed``: noise draws and data order), so a seed's
    luck cancels in its difference."""
    diffs = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    if not diffs:
        return None, None, 0
    half = t95(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return statistics.fmean(diffs), half, len(diffs)


def _val_losses(training: list[dict], arm: str, spec: dict) -> dict:
    """{seed: final validation loss (EMA)} of the lever model in ``arm``."""
    return {r["seed"]: r["final_val_loss_ema"] for r in training
            if r["arm"] == arm and r["objective"] == spec["objective"] and r.get("D") == spec.get("D")
            and r.get("final_val_loss_ema") is not None}


def lever_rows(means: list[dict], points: list[dict], ac, training: list[dict] | None = None) -> list[dict]:
    """Per arm, the lever model's most accurate setting against the baseline's (module docstring), and its
    final validation loss (EMA weights; a continuous measure, less noisy than exact match) against the
    baseline's, paired by seed."""
    obj = ac.lever_model["objective"]
    base = _of(means, "baseline", obj)
    ar = _of(means, "baseline", AR.name)
    if not base:
        return []
    b = _best(base)
    out = []
    for arm in ac.arms():
        sel = [p for p in _of(means, arm.lever.name, obj) if p.get("D") == ac.lever_model.get("D")]
        if not sel:
            continue
        best = _best(sel)
        d, ci = _diff(best, b)
        pd, pci, _ = paired(_seeds_at(points, best), _seeds_at(points, b))
        vl = _val_losses(training or [], arm.lever.name, ac.lever_model)
        vd, vci, _ = paired(vl, _val_losses(training or [], "baseline", ac.lever_model))
        ar_mode = [p for p in sel if p["rule"] == "leftmost" and p["tau"] >= HIGH_TAU and p["window"] == best["window"]]
        near = [p for p in sel if ar and p["accuracy"] >= ar[0]["accuracy"] - PARITY_POINTS]
        fast = max(near, key=lambda p: p["tokens_per_s"]) if near else None
        out.append({"arm": arm.lever.name, "lever": arm.lever.label, "source": arm.lever.source,
                    "best": best["accuracy"], "best_sd": best["accuracy_sd"], "seeds": best["seeds"],
                    "setting": _setting(best), "tokens_per_s": best["tokens_per_s"],
                    "tokens_per_step": best["tokens_per_step"], "delta": d, "delta_95": pci,
                    "delta_welch_95": ci, "val_loss": statistics.fmean(vl.values()) if vl else None,
                    "val_loss_sd": statistics.stdev(vl.values()) if len(vl) > 1 else None, "val_delta": vd,
                    "val_delta_95": vci,
                    "ar_mode": ar_mode[0]["accuracy"] if ar_mode else None,
                    "near_ar_speedup": fast["tokens_per_s"] / ar[0]["tokens_per_s"] if fast else None,
                    "near_ar_setting": _setting(fast) if fast else None})
    return out


def design_resolution(means: list[dict], points: list[dict], ac) -> dict:
    """What the design resolves (module docstring)."""
    obj = ac.lever_model["objective"]
    bests = [_best(_of(means, a.lever.name, obj)) for a in ac.arms() if _of(means, a.lever.name, obj)]
    sds = [p["accuracy_sd"] for p in bests if p.get("accuracy_sd") is not None]
    pooled = math.sqrt(statistics.fmean(s * s for s in sds)) if sds else None
    acc = statistics.median(p["accuracy"] for p in bests) if bests else 0.5
    n = max((p["n"] for p in points), default=0)
    r = resolution(n, len(ac.seeds), acc, pooled)
    base = [p for p in means if p["arm"] == "baseline" and p["objective"] == obj]
    diffs = []
    if base:
        b = _seeds_at(points, _best(base))
        for p in bests:
            if p["arm"] != "baseline":
                a = _seeds_at(points, p)
                common = sorted(set(a) & set(b))
                if len(common) > 1:
                    diffs.append(statistics.stdev(a[s] - b[s] for s in common))
    k = len(ac.seeds)
    pooled_pair = math.sqrt(statistics.fmean(x * x for x in diffs)) if diffs else None
    return {"n": n, "seeds": k, "accuracy": acc, "pooled_seed_sd": pooled, **r, "pooled_pair_sd": pooled_pair,
            "paired_difference_95": t95(k - 1) * pooled_pair / math.sqrt(k) if pooled_pair is not None else None}


__all__ = ["claims", "lever_rows", "collapse_rows", "design_resolution", "paired", "PARITY_POINTS", "PARITY_SPEEDUP",
           "COLLAPSE_POINTS"]
