"""The adaptation recipe's outputs (:mod:`.adapt`): CSVs, PNGs and its ``docs/results.md`` section.

Files under ``assets``: ``adapt_points.csv`` (one row per model, seed, initialisation and sampler setting),
``adapt_frontier.csv`` (their seed means and standard deviations), ``adapt_training.csv`` (final validation
losses, EMA, seconds), ``adapt_claims.csv``, ``adapt_frontier.png`` (seed-mean exact match against tokens/s, one
panel per initialisation, one curve per method, the seeds' standard deviation as error bars) and
``adapt_curves.png`` (validation loss against step of every fine-tune, from AR solid, from scratch dashed). The
section sits between ``<!-- adapt:begin -->`` and ``<!-- adapt:end -->``; the rest of the report file is kept.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from . import frontier as F
from .report import _f, _plm, _plt, _pm, _table, machine_meta, replace_section
from .sweep import write_csv

BEGIN, END = "<!-- adapt:begin -->", "<!-- adapt:end -->"
INIT_LABEL = {"pretrained": "pretrained AR (plain prompt)", "ar": "from AR", "scratch": "from scratch"}


def training_rows(pretrained: dict, tuned: list[dict]) -> list[dict]:
    rows = []
    for t in [{**pretrained, "init": "pretrained"}, *tuned]:
        s = json.loads((Path(t["dir"]) / "summary.json").read_text())
        rows.append({"init": t["init"], "method": F.method_label(t["spec"]), "tag": t["tag"], **t["spec"],
                     "final_val_loss": s["final_val_loss"], "final_val_loss_ema": s.get("final_val_loss_ema"),
                     "initial_val_loss": s.get("initial_val_loss"), "train_seconds": round(t["seconds"], 1),
                     "reused": t["reused"]})
    return rows


def meta(ac, command: str, wall: float, t_train: float, from_scratch: float, reused: bool) -> dict:
    budget = SimpleNamespace(train_steps=ac.finetune_steps, study_steps=0, seeds=ac.seeds, taus=ac.taus,
                             limit=ac.limit, infill_limit=0, base_config=ac.base_config, overrides=ac.overrides,
                             engine=ac.engine, batch_size=ac.batch_size)       # machine_meta's fields
    m = machine_meta(command, wall, t_train, from_scratch, reused, budget)
    return {**m, "pretrain_steps": ac.pretrain_steps, "finetune_steps": ac.finetune_steps, "finetune": ac.finetune,
            "conversations": ac.conversations, "seed": ac.seed}


def plot_frontier(points: list[dict], path: Path) -> Path:
    """``points``: the seed means (``frontier``)."""
    plt = _plt()
    inits = [i for i in ("ar", "scratch") if any(p["init"] == i for p in points)]
    fig, axes = plt.subplots(1, len(inits), figsize=(5.5 * len(inits), 4.3), dpi=120, squeeze=False, sharey=True)
    for ax, init in zip(axes[0], inits):
        sel = [p for p in points if p["init"] == init]
        for label in dict.fromkeys(p["method"] for p in sel):
            pts = sorted((p for p in sel if p["method"] == label), key=lambda p: p["tokens_per_s"])
            ax.errorbar([p["tokens_per_s"] for p in pts], [p["accuracy"] for p in pts],
                        yerr=[p.get("accuracy_sd") or 0.0 for p in pts], fmt="o-", lw=1.2, ms=4, capsize=2,
                        label=label)
        ref = [p for p in points if p["init"] == "pretrained"]
        if ref:
            ax.axhline(ref[0]["accuracy"], color="gray", ls=":", lw=1, label="pretrained AR, plain prompt")
        ax.set_title(INIT_LABEL[init])
        ax.set_xlabel("decoding tokens/s (batch 1)")
        ax.set_ylabel("held-out arithmetic exact match (chat prompt)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_curves(tuned: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.3), dpi=120)
    for t in tuned:
        if t.get("init") not in ("ar", "scratch"):
            continue
        c = F.val_curve(t["dir"])
        ax.plot([s for s, _ in c], [v for _, v in c], "-" if t["init"] == "ar" else "--", lw=1,
                label=f"{F.method_label(t['spec'])}, {INIT_LABEL[t['init']]}")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("validation loss (held-out conversations)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_assets(results: dict, trained: list[dict], assets: Path) -> dict:
    assets.mkdir(parents=True, exist_ok=True)
    files = {"adapt_points.csv": results["points"], "adapt_frontier.csv": results["frontier"],
             "adapt_training.csv": results["training"], "adapt_claims.csv": results["claims"]}
    for name, rows in files.items():
        write_csv(rows, assets / name)
    plot_frontier(results["frontier"], assets / "adapt_frontier.png")
    plot_curves(trained, assets / "adapt_curves.png")
    return {"dir": assets, "names": [*files, "adapt_frontier.png", "adapt_curves.png"]}


def _bests(frontier: list[dict]):
    """(init, method, that model's settings, its most accurate one) per model, in report order (seed means)."""
    for (init, method) in dict.fromkeys((p["init"], p["method"]) for p in frontier):
        sel = [p for p in frontier if (p["init"], p["method"]) == (init, method)]
        yield init, method, sel, max(sel, key=lambda p: (p["accuracy"], p["tokens_per_s"]))


def best_rows(frontier: list[dict]) -> list[list]:
    """Per method and initialisation (seed means): the most accurate setting, and the fastest one within 0.02
    of it."""
    out = []
    for init, method, sel, best in _bests(frontier):
        fast = max((p for p in sel if p["accuracy"] >= best["accuracy"] - 0.02), key=lambda p: p["tokens_per_s"])
        out.append([INIT_LABEL[init], method, best["seeds"], _pm(best, "accuracy"), _setting(best),
                    _pm(best, "tokens_per_s", 0), _f(fast["accuracy"]), _setting(fast), _f(fast["tokens_per_s"], 0),
                    _f(fast["tokens_per_step"], 2)])
    return out


def seed_rows(points: list[dict], frontier: list[dict]) -> list[list]:
    """Per method and initialisation with several seeds: each seed's exact match at the setting that is best on
    the mean, and each seed's own best (where the spread comes from)."""
    out = []
    for init, method, _, best in _bests(frontier):
        if best["seeds"] < 2:
            continue
        mine = [p for p in points if (p["init"], p["method"]) == (init, method)]
        seeds = sorted({p["seed"] for p in mine})
        at = {p["seed"]: p["accuracy"] for p in mine if (p.get("window"), p["tau"]) == (best["window"], best["tau"])}
        own = {s: max(p["accuracy"] for p in mine if p["seed"] == s) for s in seeds}
        out.append([INIT_LABEL[init], method, _setting(best), _plm([at[s] for s in seeds]),
                    ", ".join(f"{s}: {at[s]:.3f}" for s in seeds), ", ".join(f"{s}: {own[s]:.3f}" for s in seeds)])
    return out


def _setting(p: dict) -> str:
    tau = "1e6" if p["tau"] >= 100 else f"{p['tau']:g}"
    return (f"W={p['window']}, " if p.get("window") else "") + f"tau {tau}"


def report_lines(results: dict, files: dict, rel: str) -> list[str]:
    m = results["meta"]
    lines = [BEGIN, "## Adapting a pretrained AR model (`tools/reproduce.py --adapt`)", "",
             "Written by the command below; do not edit by hand (re-run it).", "",
             f"* Command: `{m['command']}`", f"* Commit: {m['commit']}{' (uncommitted changes)' if m['dirty'] else ''}",
             f"* Machine: {m['machine']}",
             f"* Wall time of this run: {m['wall_s'] / 60:.1f} min (training {m['train_wall_s'] / 60:.1f} min"
             + (", some models reused from an earlier run" if m["models_reused"] else "")
             + f"); from scratch: {m['from_scratch_s'] / 60:.1f} min",
             f"* Pretraining: AR with Qwen3's architecture, {m['pretrain_steps']} steps on the embedded corpus, "
             f"exported in Qwen3's layout and imported back (`train.init_from=hf:DIR`); fine-tuning: "
             f"{m['finetune_steps']} steps per model on {m['conversations']} chat conversations (packed), "
             f"`{' '.join(m['finetune'])}`, seeds {', '.join(map(str, m['seeds']))} from the AR model, seed "
             f"{m['seed']} from scratch and for the pretraining; evaluation: {m['limit']} held-out arithmetic "
             f"problems per point asked as chat prompts, greedy, batch {m['batch_size']}, EMA weights, engine "
             f"`{m['engine']}`; base `{m['base_config']}` with `{' '.join(m['overrides'])}`", "",
             "### Claims", ""]
    lines += _table(["claim", "measured", "holds"], [[c["claim"], c["value"], "yes" if c["holds"] else "**no**"]
                                                     for c in results["claims"]])
    lines += ["", "### Training (validation loss on held-out conversations; pretraining: the corpus)", ""]
    lines += _table(["model", "start", "seed", "val loss at step 0", "final val loss", "final val loss (EMA)",
                     "train s"],
                    [[r["method"], INIT_LABEL[r["init"]], r["seed"], _f(r["initial_val_loss"], 4),
                      _f(r["final_val_loss"], 4), _f(r["final_val_loss_ema"], 4), r["train_seconds"]]
                     for r in results["training"]])
    fr = results["frontier"]
    lines += ["", "### Best accuracy per model (seed means ± sd), and the fastest setting within 0.02 of it", ""]
    lines += _table(["start", "method", "seeds", "best exact match", "at", "tokens/s", "fast: exact match", "at",
                     "tokens/s", "tokens/step"], best_rows(fr))
    per_seed = seed_rows(results["points"], fr)
    if per_seed:
        lines += ["", "### Seeds (exact match at the setting best on the mean, and each seed's own best)", ""]
        lines += _table(["start", "method", "setting", "mean ± sd", "per seed", "per seed, own best setting"],
                        per_seed)
    lines += ["", "### Every setting (seed means ± sd: exact match against decoding speed)", ""]
    lines += _table(["start", "method", "seeds", "W", "tau", "exact match", "step accuracy", "tokens/s",
                     "tokens/step", "forwards", "ms/forward"],
                    [[INIT_LABEL[p["init"]], p["method"], p["seeds"], _f(p["window"]),
                      "1e6" if p["tau"] >= 100 else _f(p["tau"], 1), _pm(p, "accuracy"), _f(p["step_accuracy"]),
                      _pm(p, "tokens_per_s", 0), _f(p["tokens_per_step"], 2),
                      _f(p.get("forwards"), 0), _f(p.get("ms_per_forward"), 2)] for p in fr])
    lines += ["", "Plots: " + ", ".join(f"[{n}]({rel}/{n})" for n in files["names"] if n.endswith(".png"))
              + "; tables: " + ", ".join(f"[{n}]({rel}/{n})" for n in files["names"] if n.endswith(".csv")) + ".",
              "", END]
    return lines


def write_report(results: dict, files: dict, path: Path) -> Path:
    rel = os.path.relpath(files["dir"], Path(path).parent)
    return replace_section(Path(path), BEGIN, END, "\n".join(report_lines(results, files, rel)))


__all__ = ["training_rows", "meta", "write_assets", "write_report", "report_lines", "best_rows", "seed_rows",
           "BEGIN", "END"]
