"""The planning study's outputs: CSVs, PNGs and its ``docs/results.md`` section (see :mod:`.run`).

Files under ``assets``: ``planning_dev.csv`` (every policy of every model on every level's dev split),
``planning_test.csv`` (the chosen policies on test, with batch-1 tokens/s), ``planning_curves.csv`` (test
accuracy per task, method and level: seed mean, sd, seeds), ``planning_training.csv`` (steps, FLOPs per sample,
parameters, validation loss, seconds), ``planning_orders.json``; ``curves_<task>.png`` (accuracy against the
difficulty knob, one line per method, a band of +- one seed sd) and ``order_<task>.png`` (the step at which each
cell was filled, one grid per method).

**Verdicts** (:func:`verdicts`): for SetDLM against AR and against MDLM on every task and level, the difference of
the 3-seed test means with the 95% half-width of a difference of two k-seed means (Welch, t with 2 (k - 1) degrees
of freedom, from the two methods' seed sds): ``wins`` / ``loses`` when the difference is outside it, ``tie``
otherwise; the smallest difference the design resolves is that half-width.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
from pathlib import Path

import torch

from experiments.adapt.evaluate import t95
from experiments.paper.report import _plt, _table, replace_section
from experiments.provenance import computed_at, git_commit
from setdiff_mega.eval.sweep import write_csv

BEGIN, END = "<!-- planning:begin -->", "<!-- planning:end -->"


def curves(test: list[dict]) -> list[dict]:
    """Seed mean and sd of test accuracy per (task, method, level)."""
    by: dict = {}
    for p in test:
        by.setdefault((p["task"], p["method"], p["level"]), []).append(p)
    out = []
    for (task, method, level), ps in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        acc = [p["accuracy"] for p in ps]
        out.append({"task": task, "method": method, "level": level, "policy": ps[0]["policy"], "seeds": len(ps),
                    "accuracy": statistics.fmean(acc), "sd": statistics.stdev(acc) if len(acc) > 1 else None,
                    "n": ps[0]["n"], "tokens_per_step": statistics.fmean(p["tokens_per_step"] for p in ps),
                    "tokens_per_s": _mean([p.get("tokens_per_s") for p in ps])})
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def verdicts(rows: list[dict], target: str = "SetDLM (D=4)", against=("AR", "MDLM")) -> list[dict]:
    """SetDLM against each baseline at every task and level (module docstring)."""
    cell = {(r["task"], r["method"], r["level"]): r for r in rows}
    out = []
    for (task, method, level), r in sorted(cell.items()):
        if method != target:
            continue
        for b in against:
            o = cell.get((task, b, level))
            if o is None:
                continue
            k = min(r["seeds"], o["seeds"])
            sds = [s for s in (r["sd"], o["sd"]) if s is not None]
            half = t95(2 * (k - 1)) * math.sqrt(sum(s * s for s in sds) / max(k, 1)) if len(sds) == 2 else None
            diff = r["accuracy"] - o["accuracy"]
            verdict = "unresolved (one seed)" if half is None else "wins" if diff > half else \
                "loses" if diff < -half else "tie"
            out.append({"task": task, "level": level, "against": b, "setdlm": r["accuracy"], "baseline": o["accuracy"],
                        "difference": diff, "resolvable": half, "verdict": verdict})
    return out


def plot_curves(rows: list[dict], task: str, knob: str, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for method in sorted({r["method"] for r in rows if r["task"] == task}):
        rs = sorted((r for r in rows if r["task"] == task and r["method"] == method), key=lambda r: r["level"])
        x, y = [r["level"] for r in rs], [r["accuracy"] for r in rs]
        ax.plot(x, y, marker="o", label=method)
        sd = [r["sd"] or 0.0 for r in rs]
        ax.fill_between(x, [a - s for a, s in zip(y, sd)], [a + s for a, s in zip(y, sd)], alpha=0.2)
    ax.set_xlabel(knob), ax.set_ylabel("test accuracy (verifier)"), ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{task}: accuracy against difficulty (seed mean +- sd)"), ax.legend(fontsize=8)
    fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)
    return path


def plot_orders(orders: list[dict], path: Path) -> Path:
    """One grid per method: the step at which each answer cell was committed (lighter = earlier); a Sudoku's
    givens outlined in red."""
    plt = _plt()
    n = len(orders)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.4), squeeze=False)
    for ax, o in zip(axes[0], orders):
        cells = o["order"][:len(o["order"]) - 1] or o["order"]        # the answer's cells, EOS left out
        side = int(math.isqrt(len(cells)))
        grid = [cells[i * side:(i + 1) * side] for i in range(side)] if side * side == len(cells) else [cells]
        ax.imshow(grid, cmap="viridis_r")
        digits = [c for c in o["prompt"].split("<|", 1)[0] if c.isdigit()]
        if side * side == len(cells) == len(digits):              # a Sudoku: outline the givens (copied cells)
            for i in range(len(cells)):
                if digits[i] != "0":
                    ax.add_patch(plt.Rectangle((i % side - 0.42, i // side - 0.42), 0.84, 0.84, fill=False, ec="red",
                                               lw=1.5))
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, str(v), ha="center", va="center", fontsize=6 if side > 4 else 9, color="white")
        ax.set_title(f"{o['method']}\n{o['policy']}", fontsize=8), ax.set_xticks([]), ax.set_yticks([])
    fig.suptitle(f"{orders[0]['task']} {orders[0]['knob']}: the step each cell was filled (red: givens)", fontsize=9)
    fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)
    return path


def write_assets(results: list[dict], assets: Path) -> dict:
    assets.mkdir(parents=True, exist_ok=True)
    dev = [p for r in results for p in r["dev"]]
    test = [p for r in results for p in r["test"]]
    rows = curves(test)
    files = {"planning_dev.csv": dev, "planning_test.csv": test, "planning_curves.csv": rows,
             "planning_training.csv": [t for r in results for t in r["training"]],
             "planning_verdicts.csv": verdicts(rows)}
    for name, data in files.items():
        write_csv(data, assets / name)
    (assets / "planning_orders.json").write_text(json.dumps([o for r in results for o in r["orders"]], indent=1))
    pngs = [plot_curves(rows, r["task"], r["curve"], assets / f"curves_{r['task']}.png") for r in results]
    pngs += [plot_orders(r["orders"], assets / f"order_{r['task']}.png") for r in results if r["orders"]]
    return {"rows": rows, "verdicts": files["planning_verdicts.csv"], "files": [*files, *(p.name for p in pngs)]}


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def report_lines(results: list[dict], assets: dict, meta: dict, rel: str) -> list[str]:
    lines = [BEGIN, "## Where set decoding should beat left to right (`tools/reproduce.py --planning`)", "",
             "Written by the command below; do not edit by hand (re-run it).", "",
             f"* Command: `{meta['command']}`", f"* Commit: {meta['commit']} (the report); accuracies computed at "
             f"{computed_at([p for r in results for p in (*r['dev'], *r['test'])])}",
             f"* Machine: {meta['machine']}; wall time {meta['wall_s'] / 60:.1f} min",
             "* Equal parameters (one model per task, every method) and equal training FLOPs (the 2L methods train "
             "fewer steps); settings chosen on dev, test touched once with the chosen setting; accuracy by the "
             "task's verifier (any valid answer counts)", ""]
    lines += ["### SetDLM against AR and MDLM (test, seed means; 'resolvable' = the 95% half-width of a difference)",
              ""]
    lines += _table(["task", "level", "against", "SetDLM", "baseline", "difference", "resolvable", "verdict"],
                    [[v["task"], v["level"], v["against"], _f(v["setdlm"]), _f(v["baseline"]),
                      f"{v['difference']:+.3f}", _f(v["resolvable"]), v["verdict"]] for v in assets["verdicts"]])
    lines += ["", "### Test accuracy by difficulty (seed mean +- sd; chosen policy; batch-1 tokens/s, fp32-packed)", ""]
    lines += _table(["task", "level", "method", "policy", "accuracy", "sd", "tokens/step", "tokens/s"],
                    [[r["task"], r["level"], r["method"], r["policy"], _f(r["accuracy"]), _f(r["sd"]),
                      _f(r["tokens_per_step"], 2), _f(r["tokens_per_s"], 0)] for r in assets["rows"]])
    lines += ["", "### Training (per run)", ""]
    lines += _table(["task", "method", "seed", "steps", "GFLOPs / sample", "parameters", "val loss", "seconds"],
                    [[t["task"], t["method"], t["seed"], t["steps"], _f(t["flops_per_sample"] / 1e9, 4),
                      t["parameters"], _f(t["final_val_loss"], 4), t["seconds"]]
                     for r in results for t in r["training"]])
    lines += ["", f"Files: {', '.join(f'[{n}]({rel}/{n})' for n in assets['files'])}", "", END]
    return lines


def meta(command: str, wall_s: float, commit: str | None = None) -> dict:
    """The command, the code's commit and the machine of a report; ``commit`` as taken before the run (None: now;
    taken after, the study's own freshly written CSVs would make every report ``+dirty``)."""
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}, Python "
               f"{platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    return {"command": command.strip(), "commit": commit or git_commit(), "machine": machine, "wall_s": wall_s}


def write_report(results: list[dict], assets: dict, meta: dict, path: Path, rel: str) -> Path:
    return replace_section(path, BEGIN, END, "\n".join(report_lines(results, assets, meta, rel)))


__all__ = ["meta", "curves", "verdicts", "plot_curves", "plot_orders", "write_assets", "write_report", "report_lines",
           "BEGIN", "END"]
