"""The adaptation study's outputs (:mod:`.adapt`): CSVs, PNGs and its ``docs/results.md`` section.

Files under ``assets``: ``adapt_points.csv`` (one row per model, seed, arm and sampler setting), ``adapt_frontier.csv``
(their seed means and standard deviations), ``adapt_training.csv`` (validation losses, seconds), ``adapt_claims.csv``,
``adapt_levers.csv`` (:func:`.adapt_claims.lever_rows`), ``adapt_collapse.csv`` (:func:`.adapt_claims.collapse_rows`)
and the plots of :mod:`.adapt_plots`. The section sits between ``<!-- adapt:begin -->`` and ``<!-- adapt:end -->``;
the rest of the report file is kept.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from experiments.paper import frontier as F
from experiments.paper.report import _f, _pm, _table, asset_links, machine_meta, write_section
from experiments.provenance import computed_at
from setdiff_mega.diffusion.bd3lm import BD3LM
from setdiff_mega.diffusion.setdlm import SETDLM
from setdiff_mega.eval.sweep import write_csv

from . import plots as P
from .claims import collapse_rows

BEGIN, END = "<!-- adapt:begin -->", "<!-- adapt:end -->"


def training_rows(pretrained: dict, tuned: list[dict]) -> list[dict]:
    rows = []
    for t in [pretrained, *tuned]:
        s = json.loads((Path(t["dir"]) / "summary.json").read_text())
        rows.append({"arm": t["arm"], "lever": t.get("lever", "pretrained AR"), "method": F.method_label(t["spec"]),
                     "tag": t["tag"], **t["spec"], "steps": s["final_step"], "final_val_loss": s["final_val_loss"],
                     "final_val_loss_ema": s.get("final_val_loss_ema"), "initial_val_loss": s.get("initial_val_loss"),
                     "train_seconds": round(t["seconds"], 1), "reused": t["reused"]})
    return rows


def meta(ac, command: str, wall: float, t_train: float, from_scratch: float, reused: bool, t_speed: float) -> dict:
    budget = SimpleNamespace(train_steps=ac.finetune_steps, study_steps=0, seeds=ac.seeds, taus=ac.taus,
                             limit=ac.limit, infill_limit=0, base_config=ac.base_config, overrides=ac.overrides,
                             engine=ac.engine, batch_size=1)       # machine_meta's fields
    m = machine_meta(command, wall, t_train, from_scratch, reused, budget)
    return {**m, "pretrain_steps": ac.pretrain_steps, "finetune_steps": ac.finetune_steps, "finetune": ac.finetune,
            "conversations": ac.conversations, "seed": ac.seed, "speed_limit": ac.speed_limit,
            "eval_batch": ac.eval_batch, "speed_wall_s": round(t_speed, 1), "rules": list(ac.rules),
            "arms": [{"name": a.lever.name, "label": a.lever.label, "overrides": list(a.lever.overrides),
                      "data": a.lever.data, "steps": a.lever.steps or ac.finetune_steps, "shift": a.lever.shift,
                      "models": [F.method_label(m) for m in a.models]} for a in ac.arms()],
            "lever_model": ac.lever_model}


def _full_arms(results: dict) -> list[tuple[str, str]]:
    return [(a["name"], a["label"]) for a in results["meta"]["arms"] if len(a["models"]) > 1]


def write_assets(results: dict, trained: list[dict], assets: Path) -> dict:
    assets.mkdir(parents=True, exist_ok=True)
    files = {"adapt_points.csv": results["points"], "adapt_frontier.csv": results["frontier"],
             "adapt_training.csv": results["training"], "adapt_claims.csv": results["claims"],
             "adapt_levers.csv": results["levers"], "adapt_collapse.csv": collapse_rows(results["frontier"]),
             "adapt_test.csv": results["test_frontier"], "adapt_chosen.csv": results["chosen"]}
    for name, rows in files.items():
        write_csv(rows, assets / name)
    m, fr = results["meta"], results["frontier"]
    P.plot_frontier(fr, _full_arms(results), assets / "adapt_frontier.png")
    P.plot_levers(fr, m["lever_model"], assets / "adapt_levers.png")
    P.plot_tau(fr, m["lever_model"], m["rules"], assets / "adapt_tau.png")
    P.plot_curves([t for t in trained if t["arm"] != "pretrained"], assets / "adapt_curves.png")
    return {"dir": assets, "names": [*files, "adapt_frontier.png", "adapt_levers.png", "adapt_tau.png",
                                     "adapt_curves.png"]}


def _delta(r: dict, key: str, nd: int) -> str:
    if r.get(key) is None:
        return ""
    return f"{r[key]:+.{nd}f}" + (f" ± {r[key + '_95']:.{nd}f}" if r.get(key + "_95") is not None else "")


def _tau(p: dict) -> str:
    return "1e6" if p["tau"] >= 100 else _f(p["tau"], 1)


def _header(results: dict) -> list[str]:
    m, h, r = results["meta"], results["held_out"], results["resolution"]
    arms = "; ".join(f"**{a['name']}** ({a['label']}: {', '.join(a['models'])}; {a['steps']} steps"
                     + (f", `{' '.join(a['overrides'])}`" if a["overrides"] else "")
                     + (", self-distilled data" if a["data"] == "distill" else "")
                     + ("" if a["shift"] else ", no head shift") + ")" for a in m["arms"])
    d = results.get("distill")
    return [f"* Command: `{m['command']}`", f"* Commit: {m['commit']}{' (uncommitted changes)' if m['dirty'] else ''}"
            + f" (the report); accuracies computed at {computed_at(results['points'])}",
            f"* Machine: {m['machine']}",
            f"* Wall time of this run: {m['wall_s'] / 60:.1f} min (training and accuracies "
            f"{m['train_wall_s'] / 60:.1f} min"
            + (", some models reused from an earlier run" if m["models_reused"] else "")
            + f"; batch-1 timings {m['speed_wall_s'] / 60:.1f} min); from scratch: {m['from_scratch_s'] / 60:.1f} min",
            f"* Parent: AR with Qwen3's architecture, {m['pretrain_steps']} steps on the embedded corpus, exported in "
            f"Qwen3's layout and imported back (`train.init_from=hf:DIR`). Fine-tuning on {m['conversations']} chat "
            f"conversations (packed), `{' '.join(m['finetune'])}`, seeds {', '.join(map(str, m['seeds']))} (noise and "
            f"data order); base `{m['base_config']}` with `{' '.join(m['overrides'])}`",
            f"* Arms: {arms}" + (f"; distillation teacher: the baseline AR fine-tune of seed {m['seeds'][0]} "
                                 f"({d['answers']} answers, {d['cut']} cut at the length limit)" if d else ""),
            f"* Problems: `arithmetic` at {_knob(h['knob'])}, split by computation (a hash of the equations; no dev or "
            f"test computation in the supervised set, leak check: {h['check']['heldout_strings_checked']} held-out "
            f"solutions searched, {h['check']['leaks']} found); "
            + (f"dev / test problems whose computation is in the pretraining corpus dropped "
               f"({h['dropped_for_corpus']['dev']} / {h['dropped_for_corpus']['test']})" if h["corpus_searched"]
               else "the pretraining corpus was not searched"),
            f"* Evaluation: every setting on the {h['dev']} **dev** problems (the lever, tau and every-setting tables "
            f"below), the settings each claim needs chosen there by accuracy and tokens per step, and only those "
            f"decoded once on the {h['test']} **test** problems (the claims and the test table); chat prompts, "
            f"greedy, EMA weights, engine `{m['engine']}`, in batches of {m['eval_batch']} (a row decodes as alone); "
            f"tokens/s, forwards and ms/forward at batch 1 on the first {m['speed_limit']} problems of each split, "
            f"timed after all training and accuracy work; 'agreement' = the batch-1 answers equal to the batched "
            f"ones",
            f"* Resolution: one seed's exact match has a binomial standard error of {r['binomial_se']:.3f} at "
            f"{r['accuracy']:.2f} on {r['n']} problems; with {r['seeds']} seeds per arm and the SetDLM arms' pooled "
            f"seed sd of {_f(r['pooled_seed_sd'])}, two arms' means must differ by more than "
            f"{r['difference_95']:.3f} to be told apart at 95% unpaired (Welch, t at {2 * (r['seeds'] - 1)} degrees "
            f"of freedom); paired by seed (the arms share their seeds: noise draws and data order), with the levers' "
            f"pooled sd of per-seed differences of {_f(r.get('pooled_pair_sd'))}, by more than "
            f"{_f(r.get('paired_difference_95'))} (t at {r['seeds'] - 1})"]


def _knob(k: dict) -> str:
    return ", ".join(f"{a} = {b}" for a, b in k.items())


def _test_table(results: dict) -> list[str]:
    lines = ["", "### Test split: the settings chosen on dev, decoded once (seed means ± sd)", ""]
    return lines + _table(
        ["arm", "method", "chosen as", "W", "tau", "rule", "dev exact match", "test exact match", "tokens/s",
         "tokens/step", "agreement"],
        [[p["lever"], p["method"], (p.get("roles") or "reference").replace("+", ", "), _f(p["window"]), _tau(p),
          p["rule"], _f(next((c["dev_accuracy"] for c in results["chosen"] if (c["arm"], c["method"], c["window"],
                                c["tau"], c["rule"]) == (p["arm"], p["method"], p["window"], p["tau"], p["rule"])),
                             None)), _pm(p, "accuracy"), _pm(p, "tokens_per_s", 0), _f(p["tokens_per_step"], 2),
          _f(p.get("agreement"), 2)] for p in results["test_frontier"]])


def _same_chunk(s: dict | None) -> list[str]:
    if not s:
        return []
    n = s["size"]
    lines = ["", f"### One decode step on the same model and chunk ({s['model']}, seed {s['seed']}; SetDLM W = {n} "
                 f"against BD3LM S = {n}, tau 0: {n} pending + {n} query rows every step, batch 1)", ""]
    lines += _table(["sampler", "ms per step", "model forward", "sampler's own work", "steps timed", "chunk widths"],
                    [[m, _f(s[m]["step_ms"], 3), _f(s[m]["forward_ms"], 3), _f(s[m]["sampler_ms"], 3), s[m]["steps"],
                      ", ".join(map(str, s[m]["chunk"]))] for m in (SETDLM.name, BD3LM.name)])
    return lines + ["", f"SetDLM / BD3LM per step: **{s['setdlm_over_bd3lm']:.2f}x**."]


def report_lines(results: dict, files: dict, rel: str) -> list[str]:
    fr, lines = results["frontier"], [BEGIN, "## Adapting a pretrained AR model (`tools/reproduce.py --adapt`)", "",
                                      "Written by the command below; do not edit by hand (re-run it).", ""]
    lines += _header(results) + ["", "### Claims (parity and speed: test split, dev-chosen settings; tau: dev)", ""]
    lines += _table(["claim", "measured", "holds"], [[c["claim"], c["value"], "yes" if c["holds"] else "**no**"]
                                                     for c in results["claims"]])
    lines += _test_table(results)
    lines += ["", "### Levers (dev split; SetDLM, seed means ± sd; every lever alone against the baseline recipe)",
              ""]
    lines += _table(["arm", "lever", "where the idea comes from", "best exact match", "at", "tokens/s",
                     "tokens/step", "vs baseline (paired 95%)", "AR mode (leftmost, tau 1e6)",
                     "fastest within 3 points of the AR fine-tune", "val loss (EMA)", "vs baseline (paired 95%)"],
                    [[r["arm"], r["lever"], r["source"], _pm({"a": r["best"], "a_sd": r["best_sd"]}, "a"),
                      r["setting"], _f(r["tokens_per_s"], 0), _f(r["tokens_per_step"], 2), _delta(r, "delta", 3),
                      _f(r["ar_mode"]), f"{r['near_ar_speedup']:.2f}x ({r['near_ar_setting']})"
                      if r["near_ar_speedup"] else "none",
                      _pm({"v": r.get("val_loss"), "v_sd": r.get("val_loss_sd")}, "v", 4) if r.get("val_loss")
                      else "", _delta(r, "val_delta", 4)] for r in results["levers"]])
    lines += ["", "Exact match is at each arm's most accurate setting (seed means); the differences are paired by "
              "seed. Validation loss: the any-order NLL per token of the held-out conversations (an upper bound), EMA "
              "weights; the self-distilled arm validates on the teacher's answers, so its loss is not comparable."]
    lines += ["", "### tau against exact match (dev split; SetDLM, W = D: the collapse and the commit rules)", ""]
    lines += _table(["arm", "W", "commit rule", "lowest tau", "exact match there", "at tau 1e6", "gap"],
                    [[c["lever"], c["window"], c["rule"], _f(c["low_tau"], 1), _f(c["accuracy_low"]),
                      _f(c["accuracy_1e6"]), f"{c['gap']:+.3f}"] for c in collapse_rows(fr)])
    lines += _same_chunk(results.get("same_chunk"))
    lines += ["", "### Training (validation loss on held-out conversations, seed means)", ""]
    agg = F.aggregate(results["training"], ("arm", "lever", "method", "steps"),
                      ("initial_val_loss", "final_val_loss", "final_val_loss_ema", "train_seconds"))
    lines += _table(["arm", "model", "steps", "seeds", "val loss at step 0", "final val loss", "final (EMA)",
                     "train s"], [[r["lever"], r["method"], r["steps"], r["seeds"], _f(r["initial_val_loss"], 4),
                                   _pm(r, "final_val_loss", 4), _pm(r, "final_val_loss_ema", 4),
                                   _f(r["train_seconds"], 0)] for r in agg])
    full = {a for a, _ in _full_arms(results)} | {"pretrained"}
    lines += ["", "### Every setting of the arms with every method (dev split; seed means ± sd)", ""]
    lines += _table(["arm", "method", "seeds", "W", "tau", "rule", "exact match", "step accuracy", "tokens/s",
                     "tokens/step", "forwards", "ms/forward", "rows/forward", "agreement"],
                    [[p["lever"], p["method"], p["seeds"], _f(p["window"]), _tau(p), p["rule"], _pm(p, "accuracy"),
                      _f(p["step_accuracy"]), _pm(p, "tokens_per_s", 0), _f(p["tokens_per_step"], 2),
                      _f(p.get("forwards"), 0), _f(p.get("ms_per_forward"), 2), _f(p.get("rows_per_forward"), 1),
                      _f(p.get("agreement"), 2)] for p in fr if p["arm"] in full])
    lines += ["", "Every lever arm's settings: [adapt_frontier.csv](" + rel + "/adapt_frontier.csv).", "",
              asset_links(files["names"], rel), "", END]
    return lines


def write_report(results: dict, files: dict, path: Path) -> Path:
    return write_section(report_lines, results, files, path, BEGIN, END)


__all__ = ["training_rows", "meta", "write_assets", "write_report", "report_lines", "BEGIN", "END"]
