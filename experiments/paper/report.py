"""The reproduction's outputs: CSVs, PNGs and the ``docs/results.md`` section (see :mod:`.reproduce`).

Files under ``assets``: ``math_points.csv`` (one row per model and sampler setting), ``math_frontier.csv``
(seed means and standard deviations), ``infill.csv``, ``likelihood.csv``, ``training.csv`` and, with
the head study, ``study.csv`` (final validation losses, raw and EMA, and training seconds),
``frontier.png`` (accuracy against tokens/s and against tokens per step, one curve per method),
``quest_probe.csv`` (the quests' diagnostics per model, :mod:`.quest_probe`),
``infill.png`` (exact-match bars), ``curves.png`` (the main models' validation loss against step, and
the head study's training loss with and without the zero-initialised head). The report section sits
between ``<!-- reproduce:begin -->`` and
``<!-- reproduce:end -->`` in the report file; the rest of the file is kept.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from setdiff_mega.eval.sweep import write_csv

from . import frontier as F

BEGIN, END = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"


def training_rows(trained: list[dict], steps: int) -> list[dict]:
    rows = []
    for t in trained:
        s = json.loads((Path(t["dir"]) / "summary.json").read_text())
        train = dict(F.val_curve(t["dir"], "train/loss"))
        rows.append({"method": F.method_label(t["spec"]), "tag": t["tag"], **t["spec"], "steps": steps,
                     "final_val_loss": s["final_val_loss"], "final_val_loss_ema": s.get("final_val_loss_ema"),
                     "train_seconds": round(t["seconds"], 1), "reused": t["reused"],
                     "first_step_below_2": next((st for st, v in sorted(train.items()) if v < 2.0), None),
                     "train_loss_50": train.get(50), "train_loss_100": train.get(100),
                     "parameters": s.get("num_parameters")})
    return rows


def machine_meta(command: str, wall: float, train_wall: float, from_scratch: float, reused: bool, rc) -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                                  timeout=10).stdout.strip()          # the code's commit ("" outside a checkout)
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"command": command, "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}, Python "
                       f"{platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
            "wall_s": round(wall, 1), "train_wall_s": round(train_wall, 1), "from_scratch_s": round(from_scratch, 1),
            "models_reused": reused, "train_steps": rc.train_steps, "study_steps": rc.study_steps,
            "seeds": rc.seeds, "taus": rc.taus, "limit": rc.limit, "infill_limit": rc.infill_limit,
            "base_config": rc.base_config, "overrides": rc.overrides, "engine": rc.engine,
            "batch_size": rc.batch_size}


def _plt():
    import matplotlib  # gated: the backend is chosen before pyplot is imported (headless machines)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_frontier(frontier: list[dict], path: Path, batch_size: int = 1) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), dpi=120)
    for ax, x, name in ((axes[0], "tokens_per_s", f"decoding tokens/s (batch {batch_size})"),
                        (axes[1], "tokens_per_step", "tokens per step (parallelism)")):
        for label in dict.fromkeys(p["method"] for p in frontier):
            sel = sorted((p for p in frontier if p["method"] == label), key=lambda p: p[x])
            ax.plot([p[x] for p in sel], [p["accuracy"] for p in sel], "o-", lw=1.2, ms=4, label=label)
        ax.set_xlabel(name)
        ax.set_ylabel("arithmetic exact match (seed mean)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_infill(infill: list[dict], path: Path) -> Path:
    plt = _plt()
    tasks = list(dict.fromkeys(r["task"] for r in infill))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.3), dpi=120, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in infill if r["task"] == task]
        labels = [f"{r['method']}\n{r['context']}" + (f", W={r['window']}" if r.get("window") else "") for r in rows]
        ax.bar(range(len(rows)), [r["exact_match"] for r in rows],
               color=["tab:gray" if r["context"] == "left only" else "tab:blue" for r in rows])
        ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=6)
        ax.set_ylabel("exact match (seed mean)")
        ax.set_title(task)
        ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_curves(main: list[dict], study: list[dict], path: Path) -> Path:
    plt = _plt()
    panels = [(main, "main models: validation loss", "val/loss")]
    if study:
        panels.append((study, "head study: training loss (dashed: zero head)", "train/loss"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.3), dpi=120, squeeze=False)
    for ax, (runs, title, key) in zip(axes[0], panels):
        for t in runs:
            c = F.val_curve(t["dir"], key)
            style = "--" if t["spec"].get("zero_init_head") else "-"
            ax.plot([s for s, _ in c], [v for _, v in c], style, lw=1, label=t["tag"])
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_assets(results: dict, main: list[dict], study: list[dict], assets: Path) -> dict:
    assets.mkdir(parents=True, exist_ok=True)
    frontier, infill = results["frontier"], results["infill_means"]
    files = {"math_points.csv": results["points"], "math_frontier.csv": frontier, "infill.csv": infill,
             "likelihood.csv": results["likelihood"], "training.csv": results["training"],
             **({"study.csv": results["study"]} if results["study"] else {}),
             **({"quest_probe.csv": results["quest_probe"]} if results.get("quest_probe") else {}),
             "claims.csv": results["claims"]}
    for name, rows in files.items():
        write_csv([{k: v for k, v in r.items() if k != "example"} for r in rows], assets / name)
    plot_frontier(frontier, assets / "frontier.png", results["meta"].get("batch_size", 8))
    plot_infill(infill, assets / "infill.png")
    plot_curves(main, study, assets / "curves.png")
    return {"dir": assets, "names": [*files, "frontier.png", "infill.png", "curves.png"]}


def _f(v, nd=3):
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _pm(r, k, nd=3):
    sd = r.get(k + "_sd")
    return _f(r[k], nd) + (f" ± {sd:.{nd}f}" if sd is not None else "")


def _plm(vals: list[float], nd: int = 3) -> str:
    """Mean ± sample standard deviation of ``vals`` (the mean alone for one value)."""
    return _pm(F.aggregate([{"v": v} for v in vals], (), ("v",))[0], "v", nd)


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def _study_table(study: list[dict]) -> list[list]:
    groups: dict = {}
    for r in study:
        groups.setdefault((F.method_label({k: v for k, v in r.items() if k in ("objective", "D", "block_size")}),
                           r["zero_init_head"]), []).append(r)
    rows = []
    for (label, zh), rs in groups.items():
        agg = F.aggregate(rs, ("method",), ("final_val_loss",))[0]
        firsts = [r["first_step_below_2"] for r in rs]
        at = lambda k: ", ".join(_f(r[k]) for r in rs)  # noqa: E731
        rows.append([label, "zero (paper)" if zh else "normal", len(rs), at("train_loss_50"), at("train_loss_100"),
                     ", ".join("never" if f is None else str(f) for f in firsts), _pm(agg, "final_val_loss")])
    return rows


def _quest_probe_lines(rows: list[dict]) -> list[str]:
    """The quests' diagnostics table (:mod:`.quest_probe`), one row per model and seed."""
    if not rows:
        return []
    lines = ["", "### Quests: what a fill commits first, and which goal it names (both sides; W = D; per seed)", "",
             "First commit: its place in the span (0 = the first token, 1 = the last) and confidence. Goal token: "
             "the first token where the eight goals' sentences differ; rank = span tokens committed before it.", ""]
    return lines + _table(
        ["method", "seed", "exact match", "goal named: right / wrong / none", "first commit: place", "confidence",
         "goal token: rank", "right", "confidence (right / wrong)", "exact match when the goal token is right"],
        [[r["method"], r.get("seed"), _f(r["exact_match"]),
          f"{r['goal_right']:.2f} / {r['goal_wrong']:.2f} / {r['goal_none']:.2f}", _f(r["first_relative"], 2),
          _f(r["first_confidence"], 2), _f(r["goal_rank"], 1), _f(r["goal_token_right"], 2),
          f"{_f(r['goal_confidence_right'], 2) or '-'} / {_f(r['goal_confidence_wrong'], 2) or '-'}",
          _f(r["exact_given_goal_right"])] for r in rows])


def report_lines(results: dict, files: dict, rel: str) -> list[str]:
    m = results["meta"]
    scratch = f"{m['from_scratch_s'] / 60:.1f} min"
    lines = [BEGIN, "## Reproduction of the paper's claims (`tools/reproduce.py`)", "",
             "Written by the command below; do not edit by hand (re-run it).", "",
             f"* Command: `{m['command']}`", f"* Commit: {m['commit']}{' (uncommitted changes)' if m['dirty'] else ''}",
             f"* Machine: {m['machine']}",
             f"* Wall time of this run: {m['wall_s'] / 60:.1f} min (training {m['train_wall_s'] / 60:.1f} min"
             + (", some models reused from an earlier run" if m["models_reused"] else "")
             + f"); from scratch: {scratch}",
             f"* Budget: {m['train_steps']} steps per model"
             + (f" (head study {m['study_steps']})" if results["study"] else "") + f", seeds {m['seeds']}, "
             f"{m['limit']} arithmetic problems per point, {m['infill_limit']} stories / quests per infilling row, "
             f"EMA weights, decoding engine `{m.get('engine', 'native')}`; base `{m['base_config']}` with "
             f"`{' '.join(m['overrides'])}`", "",
             "### Claims", ""]
    lines += _table(["claim", "measured", "holds"], [[c["claim"], c["value"], "yes" if c["holds"] else "**no**"]
                                                     for c in results["claims"]])
    lines += ["", "### Training (validation loss at the last step)", ""]
    lines += _table(["model", "seed", "val loss", "val loss (EMA)", "first step train loss < 2", "train s"],
                    [[r["method"], r.get("seed"), _f(r["final_val_loss"], 4), _f(r["final_val_loss_ema"], 4),
                      r["first_step_below_2"] or "never", r["train_seconds"]] for r in results["training"]])
    if results["study"]:
        lines += ["", f"### Head study ({m['study_steps']} steps, zero-initialised vs normally initialised "
                      f"output head)",
                  ""]
        lines += _table(["model", "head", "seeds", "train loss at step 50", "at step 100", "first step train loss < 2",
                         "final val loss (mean ± sd)"], _study_table(results["study"]))
        lines += ["", "(per seed; train loss logged every 10 steps)"]
    else:
        lines += ["", "Head study: not run (`--study`); its last measurement is quoted below the section."]
    lines += ["", f"### Arithmetic: accuracy against decoding speed (seed means ± sd; greedy; batch "
              f"{m.get('batch_size', 8)}; forwards: model calls over all problems, prefills included)", ""]
    lines += _table(["method", "W", "tau", "exact match", "step accuracy", "operand copied", "tokens/s",
                     "tokens/step", "forwards", "ms/forward"],
                    [[r["method"], _f(r["window"]), _f(r["tau"], 1) if r["tau"] < 100 else "1e6", _pm(r, "accuracy"),
                      _f(r["step_accuracy"]), _f(r["copy_accuracy"]), _f(r["tokens_per_s"], 0),
                      _f(r["tokens_per_step"], 2), _f(r.get("forwards"), 0), _f(r.get("ms_per_forward"), 2)]
                     for r in results["frontier"]])
    lines += ["", "### Infilling (oracle span length; infill preset: tau 1e6, W = 2D and also W = D for SetDLM, "
              "repetition penalty 1.2 for the stories and 1.0 for the templated quests)", ""]
    lines += _table(["task", "method", "context", "W", "exact match", "ROUGE-L", "tokens/s"],
                    [[r["task"], r["method"], r["context"], _f(r.get("window")), _pm(r, "exact_match"),
                      _pm(r, "rouge_l"),
                      _f(r["tokens_per_s"], 0)] for r in results["infill_means"]])
    lines += _quest_probe_lines(results.get("quest_probe") or [])
    lines += ["", "### Likelihood (validation NLL per token; upper bounds except AR)", ""]
    lines += _table(["model", "seed", "estimator", "NLL/token", "SetDLM one order", "SetDLM K-order bound", "K"],
                    [[r["method"], r.get("seed"), r["estimator"], _f(r["nll_per_token"], 4),
                      _f(r.get("nll_one_order"), 4),
                      _f(r.get("nll_k_orders"), 4), r["orders"]] for r in results["likelihood"]])
    return lines + ["", asset_links(files["names"], rel), "", END]


def asset_links(names: list[str], rel: str) -> str:
    """"Plots: ...; tables: ..." with a relative link to each PNG and CSV of ``names`` under ``rel``."""
    return ("Plots: " + ", ".join(f"[{n}]({rel}/{n})" for n in names if n.endswith(".png"))
            + "; tables: " + ", ".join(f"[{n}]({rel}/{n})" for n in names if n.endswith(".csv")) + ".")


def write_section(lines_of, results: dict, files: dict, path: Path, begin: str = BEGIN, end: str = END) -> Path:
    """Replace (or append) the section between ``begin`` and ``end`` of ``path`` with ``lines_of(results, files,
    rel)`` (``rel``: the assets folder relative to ``path``'s folder)."""
    rel = os.path.relpath(files["dir"], Path(path).parent)
    return replace_section(Path(path), begin, end, "\n".join(lines_of(results, files, rel)))


def write_report(results: dict, files: dict, path: Path) -> Path:
    """Replace (or append) the reproduction section of ``path``."""
    return write_section(report_lines, results, files, path)


def replace_section(path: Path, begin: str, end: str, section: str) -> Path:
    """Put ``section`` (which starts with ``begin`` and ends with ``end``) in place of the file's section between
    those markers, or append it; the rest of the file is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.is_file() else "# Measured results\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
    return path


__all__ = ["training_rows", "machine_meta", "write_assets", "write_report", "write_section", "asset_links",
           "report_lines", "replace_section",
           "BEGIN", "END"]
