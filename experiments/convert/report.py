"""The conversion study's outputs: CSVs, PNGs and its generated section of ``docs/results.md`` (between
``<!-- convert:begin -->`` and ``<!-- convert:end -->``; the rest of the file is kept).

Files under ``assets``: ``convert_dev.csv`` (every dev point), ``convert_test.csv`` (the test points of the chosen
settings), ``convert_rows.csv`` (test seed means per task, arm and setting, with the batch-1 timings),
``convert_nll.csv``, ``convert_training.csv``, ``convert_calibration.csv``, ``convert_claims.csv``,
``convert_levers.csv`` (:func:`lever_rows`), ``convert_missing.csv`` and ``frontier_<task>.png`` (test exact
match against batch-1 tokens/s, one marker per arm and setting, error bars of +- one seed sd; tokens per step on
the x axis while no timing exists).

**Claims** (:func:`claims`), per task, on the test seed means of the settings chosen on dev:

* parity with AR: SetDLM (base recipe, role ``parity_ar``) within 3 points of the AR fine-tune (best) at >= 2x
  its batch-1 tokens/s;
* the paper's speed claim: SetDLM (role ``parity_bd3lm``) within 3 points of BD3LM's best at >= 1.5x its tokens/s.

Each is ``holds`` / ``missed`` (also when no setting came within 3 points on dev: SetDLM's best row is shown) /
``not run yet`` (a point or timing is missing; ``not applicable`` when the AR
fine-tune's test exact match is outside the calibration band: a saturated task cannot tell the methods apart;
fewer than 3 seeds are stated), with the difference of the means,
the speed ratio and the **smallest resolvable difference**: the larger of ``2 sd / sqrt(k)`` (sd: the two arms'
pooled seed sd, k seeds) and the binomial sd ``sqrt(p (1 - p) / n)`` of one n-problem accuracy.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from experiments.paper.report import _plt, _table, replace_section
from experiments.planning.report import meta
from experiments.provenance import computed_at
from setdiff_mega.eval.sweep.report import write_csv

from .evaluate import PARITY, setting_name
from .plan import BAND

BEGIN, END = "<!-- convert:begin -->", "<!-- convert:end -->"
_GGUF = " (every tensor of the GGUF file dequantised to fp32: the parent is the dequantised model)"
PARENT_NLL = 3.1909          # docs/results.md "Converting SmolLM2-135M: the parent" (the AR import, kjv, L = 256)
CLAIMS = (("parity_ar", "causal", "best", 2.0, "SetDLM within 3 points of the AR fine-tune at >= 2x its tokens/s"),
          ("parity_bd3lm", "block", "best", 1.5, "SetDLM at BD3LM's best exact match at >= 1.5x its tokens/s"))


def _sd(xs: list[float]) -> float | None:
    return statistics.stdev(xs) if len(xs) > 1 else None


def test_rows(res: dict) -> list[dict]:
    """Test seed means per (arm, setting) of one task, with its roles and the first seed's timing."""
    by: dict = {}
    for p in res["test"]:
        by.setdefault((p["arm"], setting_name(p["setting"])), []).append(p)
    times = {(t["arm"], t["setting"]): t for t in res.get("timings", [])}
    out = []
    for (arm, name), ps in sorted(by.items()):
        acc = [p["accuracy"] for p in ps]
        roles = [r for r, s in res["roles"].get(arm, {}).items() if s == name]
        t = times.get((arm, name), {})
        out.append({"task": res["task"], "knob": res["knob"], "arm": arm, "method": ps[0]["method"],
                    "kind": ps[0]["kind"], "recipe": ps[0]["recipe"], "setting": name, "roles": "+".join(roles),
                    "seeds": len(ps), "accuracy": statistics.fmean(acc), "sd": _sd(acc), "n": ps[0]["n"],
                    "tokens_per_step": statistics.fmean(p["tokens_per_step"] for p in ps),
                    "tokens_per_s": t.get("tokens_per_s"), "tokens_per_forward": t.get("tokens_per_forward")})
    return out


def _role_row(rows: list[dict], kind: str, role: str) -> dict | None:
    return next((r for r in rows if r["kind"] == kind and r["recipe"] == "base" and role in r["roles"].split("+")),
                None)


def resolvable(a: dict, b: dict) -> float:
    """The smallest difference of two arms' test means the design resolves (module docstring)."""
    k = min(a["seeds"], b["seeds"])
    sds = [s for s in (a["sd"], b["sd"]) if s is not None]
    seed = 2 * math.sqrt(sum(s * s for s in sds) / len(sds)) / math.sqrt(k) if sds else 0.0
    p = (a["accuracy"] + b["accuracy"]) / 2
    return max(seed, math.sqrt(max(p * (1 - p), 0.0) / max(min(a["n"], b["n"]), 1)))


def _status(c: dict, ratio: float, ar: dict | None, seeds: int, band: tuple, short: bool = False) -> str:
    """holds / missed; "not run yet (timings)"; "not applicable" when the AR fine-tune's test exact match is
    outside the band (a saturated or floored task tells the methods apart no more); the seeds when fewer than 3;
    ``short``: no dev setting came within :data:`PARITY` of the baseline (missed whatever the speed; the row
    is SetDLM's best)."""
    if ar is not None and not band[0] <= ar["accuracy"] <= band[1]:
        return f"not applicable (AR test exact match {ar['accuracy']:.3f} outside [{band[0]}, {band[1]}])"
    if short:
        return "missed (no setting within 3 points on dev; SetDLM's best shown)"
    if c["speed_ratio"] is None:
        return "not run yet (timings)"
    ok = c["difference"] >= -PARITY and c["speed_ratio"] >= ratio
    return ("holds" if ok else "missed") + ("" if seeds >= 3 else f" ({seeds} seed{'s' * (seeds > 1)} of 3)")


def claims(task_rows: list[dict], task: str, band: tuple = BAND, roles: dict | None = None) -> list[dict]:
    """Both claims on one task's test rows (module docstring); ``roles`` the task's {arm: {role: setting}} from
    dev: an arm without the claim's role had no setting within :data:`PARITY` of the baseline on dev, and its
    ``best`` row stands in (missed)."""
    out = []
    for role, against, their, ratio, text in CLAIMS:
        mine, ref = _role_row(task_rows, "window", role), _role_row(task_rows, against, their)
        best = _role_row(task_rows, "window", "best")
        chosen = (roles or {}).get(best["arm"]) if best is not None else None     # that arm's roles on dev
        short = mine is None and ref is not None and chosen is not None and role not in chosen
        mine = best if short else mine
        c = {"task": task, "claim": text, "status": "not run yet", "setdlm": None, "baseline": None,
             "difference": None, "speed_ratio": None, "resolvable": None}
        if mine is None or ref is None:
            out.append(c)
            continue
        c.update(setdlm=mine["accuracy"], baseline=ref["accuracy"], difference=mine["accuracy"] - ref["accuracy"],
                 setdlm_sd=mine["sd"], baseline_sd=ref["sd"],
                 resolvable=resolvable(mine, ref), setting=mine["setting"], baseline_setting=ref["setting"])
        if mine["tokens_per_s"] is not None and ref["tokens_per_s"] is not None:
            c["speed_ratio"] = mine["tokens_per_s"] / ref["tokens_per_s"]
        c["status"] = _status(c, ratio, _role_row(task_rows, "causal", "best"), min(mine["seeds"], ref["seeds"]), band,
                              short)
        out.append(c)
    return out


def _mean_of(ps: list[dict], key: str) -> float | None:
    xs = [p[key] for p in ps if p.get(key) is not None]
    return statistics.fmean(xs) if xs else None


def dev_rows(res: dict) -> list[dict]:
    """Dev seed means +- sd per (arm, setting) of one task, with the roles chosen on them."""
    by: dict = {}
    for p in res["dev"]:
        by.setdefault((p["arm"], setting_name(p["setting"])), []).append(p)
    out = []
    for (arm, name), ps in sorted(by.items()):
        acc = [p["accuracy"] for p in ps]
        out.append({"task": res["task"], "arm": arm, "setting": name, "seeds": len(ps),
                    "accuracy": statistics.fmean(acc), "sd": _sd(acc),
                    "tokens_per_step": _mean_of(ps, "tokens_per_step"),
                    "commits_per_step": _mean_of(ps, "commits_per_step"),
                    "roles": "+".join(r for r, s in res["roles"].get(arm, {}).items() if s == name)})
    return out


def lever_rows(res: dict, rows: list[dict]) -> list[dict]:
    """Each lever arm of one task against its own method's base recipe **on the same seed** (the levers' seed)
    and against the AR fine-tune's best (3-seed mean), every arm at its ``best`` setting chosen on dev (test)."""
    best = {arm: roles.get("best") for arm, roles in res["roles"].items()}
    point = {(p["arm"], p["seed"]): p for p in res["test"] if setting_name(p["setting"]) == best.get(p["arm"])}
    ar = _role_row(rows, "causal", "best")
    out = []
    for (arm, seed), p in sorted(point.items()):
        if p["recipe"] == "base":
            continue
        base = point.get((f"{arm.split('/')[0]}/base", seed))
        out.append({"task": res["task"], "arm": arm, "seed": seed, "setting": best[arm], "accuracy": p["accuracy"],
                    "tokens_per_step": p["tokens_per_step"], "base_setting": base and best[base["arm"]],
                    "base_accuracy": base and base["accuracy"],
                    "vs_base": None if base is None else p["accuracy"] - base["accuracy"],
                    "ar_best": ar and ar["accuracy"], "vs_ar": None if ar is None else p["accuracy"] - ar["accuracy"]})
    return out


def nll_rows(results: dict) -> list[dict]:
    by: dict = {}
    for r in results["tasks"]:
        for p in r["nll"]:
            k = ("", "parent") if p["arm"] == "parent" else (p["task"], p["arm"])
            by.setdefault(k, []).append(p)
    return [{"task": t, "arm": a, "method": ps[0]["method"], "estimator": ps[0]["estimator"],
             "seeds": len({p["seed"] for p in ps}),
             "nll_per_token": statistics.fmean(p["nll_per_token"] for p in ps),
             "sd": _sd([p["nll_per_token"] for p in ps]), "parent_documented": PARENT_NLL}
            for (t, a), ps in sorted(by.items())]


def plot_frontier(rows: list[dict], task: str, path: Path) -> Path:
    plt = _plt()
    timed = all(r["tokens_per_s"] is not None for r in rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in sorted({r["arm"] for r in rows}):
        rs = [r for r in rows if r["arm"] == arm]
        x = [r["tokens_per_s"] if timed else r["tokens_per_step"] for r in rs]
        ax.errorbar(x, [r["accuracy"] for r in rs], yerr=[r["sd"] or 0.0 for r in rs], fmt="o", capsize=3,
                    label=arm)
    ax.set_xlabel("batch-1 tokens/s (fp32-packed)" if timed else "tokens per step (not timed yet)")
    ax.set_ylabel("test exact match (seed mean +- sd)"), ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{task}: accuracy against speed"), ax.legend(fontsize=7)
    fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)
    return path


def write_assets(results: dict, assets: Path) -> dict:
    assets.mkdir(parents=True, exist_ok=True)
    rows = [r for t in results["tasks"] for r in test_rows(t)]
    cl = [c for t in results["tasks"] for c in claims([r for r in rows if r["task"] == t["task"]], t["task"],
                                                          roles=t["roles"])]
    flat = lambda ps: [{**{k: v for k, v in p.items() if k not in ("correct", "computed_at")},  # noqa: E731
                        "setting": setting_name(p["setting"]) if p.get("setting") else ""} for p in ps]
    cal = [{"task": t["task"], **x} for t in results["tasks"] for x in t["calibration"]["tried"]]
    files = {"convert_dev.csv": flat([p for t in results["tasks"] for p in t["dev"]]),
             "convert_test.csv": flat([p for t in results["tasks"] for p in t["test"]]), "convert_rows.csv": rows,
             "convert_nll.csv": nll_rows(results), "convert_training.csv": flat([p for t in results["tasks"]
                                                                                 for p in t["train"]]),
             "convert_calibration.csv": cal, "convert_claims.csv": cl, "convert_missing.csv": results["missing"],
             "convert_levers.csv": [x for t in results["tasks"] for x in lever_rows(t, [r for r in rows
                                                                                       if r["task"] == t["task"]])]}
    for name, data in files.items():
        write_csv(data, assets / name)
    pngs = [plot_frontier([r for r in rows if r["task"] == t["task"]], t["task"], assets / f"frontier_{t['task']}.png")
            for t in results["tasks"] if any(r["task"] == t["task"] for r in rows)]
    return {"rows": rows, "claims": cl, "nll": files["convert_nll.csv"], "levers": files["convert_levers.csv"],
            "files": [*files, *(p.name for p in pngs)]}


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def _pm(x, sd) -> str:
    return _f(x) + ("" if x is None or sd is None else f" +- {sd:.3f}")


def _missing_lines(missing: list[dict]) -> list[str]:
    by: dict = {}
    for m in missing:
        by.setdefault((m["task"], m["arm"], m["point"], m["split"]), set()).add(m["seed"])
    return [f"* {t} {a}: {p}{f' ({s})' if s else ''}, seeds {', '.join(map(str, sorted(seeds)))}: not run yet"
            for (t, a, p, s), seeds in sorted(by.items())] or ["* none"]


def _task_lines(t: dict, rows: list[dict], levers: list[dict]) -> list[str]:
    cal = t["calibration"]
    lines = [f"### {t['task']}: knob {t['knob'] or 'not chosen yet'}", "",
             f"Calibration (AR fine-tune, first seed, dev): {cal.get('why', '')}; tried: "
             + (", ".join(f"{x['knob']} {x['accuracy']:.3f}" for x in cal["tried"]) or "nothing yet"), ""]
    if t.get("check"):
        lines += [f"Leak check: {t['check']['heldout_strings_checked']} held-out strings, {t['check']['leaks']} leaks; "
                  f"lengths: {t.get('lengths')}", ""]
    lines += _table(["arm", "setting", "roles", "seeds", "test EM", "sd", "n", "tok/step", "tok/s", "tok/forward"],
                    [[r["arm"], r["setting"], r["roles"], r["seeds"], _f(r["accuracy"]), _f(r["sd"]), r["n"],
                      _f(r["tokens_per_step"], 2), _f(r["tokens_per_s"], 1), _f(r["tokens_per_forward"], 2)]
                     for r in rows if r["task"] == t["task"]])
    dev = dev_rows(t)
    if dev:
        lines += ["", f"Dev split (every setting; the roles are chosen on these seed means; n = {t['dev'][0]['n']}; "
                  "tok/step: the tokens delivered, up to and including EOS, per decoding step; commits/step: every "
                  "commit per step, also those past EOS that the output drops, the reference's parallelism factor):",
                  ""]
        lines += _table(["arm", "setting", "seeds", "dev EM", "sd", "tok/step", "commits/step", "roles"],
                        [[r["arm"], r["setting"], r["seeds"], _f(r["accuracy"]), _f(r["sd"]),
                          _f(r["tokens_per_step"], 2), _f(r["commits_per_step"], 2), r["roles"] or "-"]
                         for r in dev])
    levers = [x for x in levers if x["task"] == t["task"]]
    if levers:
        lines += ["", "Levers (test, each at its best dev setting; against its method's base recipe on the same "
                  "seed, and the AR fine-tune's 3-seed mean):", ""]
        lines += _table(["lever arm", "seed", "setting", "test EM", "tok/step", "base (same seed)", "vs base",
                         "vs AR best"],
                        [[x["arm"], x["seed"], x["setting"], _f(x["accuracy"]), _f(x["tokens_per_step"], 2),
                          f"{_f(x['base_accuracy'])} ({x['base_setting'] or '-'})", _sg(x["vs_base"]),
                          _sg(x["vs_ar"])] for x in levers])
    return lines + [""]


def _sg(x) -> str:
    return "-" if x is None else f"{x:+.3f}"


def report_lines(results: dict, assets: dict, m: dict, rel: str) -> list[str]:
    pts = [p for t in results["tasks"] for k in ("dev", "test", "nll", "train") for p in t[k]]
    b = results["budget"]
    lines = [BEGIN, "## Converting SmolLM2-135M into a SetDLM (`tools/reproduce.py --convert`)", "",
             "Written by the command below; do not edit by hand (re-run it).", "",
             f"* Command: `{m['command']}`", f"* Commit: {m['commit']} (the report); points from "
             f"{computed_at(pts) if pts else 'no points yet'}",
             f"* Machine (timings): {m['machine']}; wall time {m['wall_s'] / 60:.1f} min",
             f"* Parent: `{results['parent']}` (sha256 {results['parent_sha'][:12]}...), imported once as AR"
             f"{_GGUF if str(results['parent']).endswith('.gguf') else ''}; every child fine-tuned from it",
             f"* Planned budget: {b['total_s'] / 3600:.1f} h (+ calibration up to "
             f"{b['calibration_worst_s'] / 3600:.1f} h); the longest arm with one seed "
             f"{b['longest_arm_s'] / 60:.1f} min", "", "### Claims (test split)", ""]
    lines += _table(["task", "claim", "SetDLM (mean +- sd)", "baseline", "difference", "resolvable", "speed ratio",
                     "status"],
                    [[c["task"], c["claim"], _pm(c["setdlm"], c.get("setdlm_sd")),
                      _pm(c["baseline"], c.get("baseline_sd")),
                      "-" if c["difference"] is None else f"{c['difference']:+.3f}", _f(c["resolvable"]),
                      _f(c["speed_ratio"], 2), f"**{c['status']}**"] for c in assets["claims"]])
    lines += [""]
    for t in results["tasks"]:
        lines += _task_lines(t, assets["rows"], assets["levers"])
    lines += ["### Held-out NLL (KJV, L = 256; the diffusion children's values are bounds)", ""]
    lines += _table(["task", "arm", "estimator", "seeds", "NLL / token", "sd", "parent (documented)"],
                    [[r["task"] or "-", r["arm"], r["estimator"], r["seeds"], _f(r["nll_per_token"], 4),
                      _f(r["sd"], 4), _f(r["parent_documented"], 4)] for r in assets["nll"]])
    lines += ["", "### Not run yet", "", *_missing_lines(results["missing"]), "",
              f"Files: {', '.join(f'[{n}]({rel}/{n})' for n in assets['files'])}", "", END]
    return lines


def write_report(results: dict, assets: dict, command: str, wall_s: float, path: Path, rel: str,
                 commit: str | None = None) -> Path:
    return replace_section(path, BEGIN, END,
                           "\n".join(report_lines(results, assets, meta(command, wall_s, commit), rel)))


__all__ = ["BEGIN", "END", "PARENT_NLL", "CLAIMS", "test_rows", "claims", "resolvable", "dev_rows", "lever_rows",
           "nll_rows", "plot_frontier", "write_assets", "report_lines", "write_report"]
