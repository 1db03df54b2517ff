"""The speed-quality frontier: AR, MDLM, BD3LM (several S) and SetDLM (several D) at one model size and
token budget, each decoded with a sweep of sampler settings; plus the infilling comparison.

For every method a model of the same size is trained for the same number of steps (``pretrain.py``
subprocesses, resumable: a finished model is reused). Each (model, sampler setting) point decodes the
held-out math problems and records exact-match accuracy, arithmetic-step accuracy, tokens/s, NFE and
tokens per step:

    AR       greedy, one token per step (cached)
    MDLM     semi-autoregressive blocks of 32, tau in taus (top-1 + tau commits per step)
    BD3LM(S) blocks of S with the block KV cache, tau in taus
    SetDLM(D) window W in {D, 2D}, tau in taus (tau > 1: one token per step)

Outputs: ``frontier.csv`` (one row per point), ``frontier.png`` (accuracy against tokens/s, one curve per
method; the step accuracy in a second panel), ``infill.csv`` (story infilling: SetDLM and BD3LM with
both sides, AR with the left context only) and ``summary.json`` with SetDLM's tokens/s at BD3LM's best
accuracy.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .sweep import write_csv

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FrontierConfig:
    out_dir: str = "runs/frontier"
    base_config: str = "configs/tiny_cpu.yaml"
    overrides: list = field(default_factory=lambda: ["train.eval_interval=0", "logging.wandb=disabled",
                                                     "logging.progress=false"])
    train_steps: int = 500
    methods: list = field(default_factory=lambda: [
        {"objective": "ar"}, {"objective": "mdlm"}, {"objective": "bd3lm", "block_size": 4},
        {"objective": "bd3lm", "block_size": 16}, {"objective": "setdlm", "D": 2},
        {"objective": "setdlm", "D": 4}, {"objective": "setdlm", "D": 8}])
    taus: list = field(default_factory=lambda: [0.5, 0.7, 0.9, 2.0])
    limit: int = 48                      # math problems per point
    infill_limit: int = 48
    max_new_tokens: int = 96
    batch_size: int = 8


def method_tag(m: dict) -> str:
    extra = "".join(f"_{k}{v}" for k, v in sorted(m.items()) if k != "objective")
    return f"{m['objective']}{extra}"


def method_label(m: dict) -> str:
    if m["objective"] == "bd3lm":
        return f"BD3LM (S={m['block_size']})"
    if m["objective"] == "setdlm":
        return f"SetDLM (D={m['D']})"
    return m["objective"].upper()


def train_models(fc: FrontierConfig, log=print) -> dict:
    """Train (or reuse) one model per method; returns {tag: checkpoint dir}."""
    out = {}
    for m in fc.methods:
        tag = method_tag(m)
        save = Path(fc.out_dir) / "models" / tag
        over = [f"objective.name={m['objective']}", f"train.train_steps={fc.train_steps}", f"train.save_dir={save}",
                *(f"objective.{k}={v}" for k, v in m.items() if k != "objective")]
        summary = save / "summary.json"
        done = summary.is_file() and json.loads(summary.read_text()).get("final_step") == fc.train_steps
        if not done:
            log(f"training {tag} ({fc.train_steps} steps)")
            save.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            with open(save / "train.log", "a") as f:
                p = subprocess.run([sys.executable, "pretrain/pretrain.py", "--config", fc.base_config,
                                    *fc.overrides, *over], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
            if p.returncode != 0:
                raise RuntimeError(f"training {tag} failed (exit {p.returncode}); see {save / 'train.log'}")
            log(f"  {tag}: {time.perf_counter() - t:.0f}s, val loss {json.loads(summary.read_text())['final_val_loss']}")
        out[tag] = save
    return out


def settings(m: dict, taus: list) -> list[dict]:
    if m["objective"] == "ar":
        return [{"tau": 2.0}]
    if m["objective"] == "setdlm":
        return [{"window": w, "tau": t} for w in (m["D"], 2 * m["D"]) for t in taus]
    return [{"tau": t} for t in taus]


def evaluate_points(fc: FrontierConfig, models: dict, task_dir: str, log=print, progress=None) -> list[dict]:
    from setdiff_mega.checkpoint import load_model
    from setdiff_mega.inference import GenerationConfig

    from .tasks import load_task, math_accuracy

    rows_math = load_task(task_dir, "math", fc.limit)
    points = []
    for m in fc.methods:
        model, objective, tok, cfg = load_model(models[method_tag(m)])
        L = cfg.data.seq_length
        for s in settings(m, fc.taus):
            gc = GenerationConfig(max_new_tokens=fc.max_new_tokens, window=s.get("window", cfg.objective.D),
                                  tau=s["tau"], block_size=m.get("block_size", 32))
            r = math_accuracy(model, tok, m["objective"], rows_math, gc, L, fc.batch_size)
            row = {"method": method_label(m), "tag": method_tag(m), **{k: v for k, v in m.items()}, **s,
                   "accuracy": r["accuracy"], "step_accuracy": r["step_accuracy"], "tokens_per_s": r["tokens_per_s"],
                   "tokens_per_step": r["tokens_per_step"], "nfe": r["nfe"], "n": r["n"]}
            points.append(row)
            log(f"  {row['method']:<16} {s}: acc {row['accuracy']:.3f}, step acc {row['step_accuracy']:.3f}, "
                f"{row['tokens_per_s']:.0f} tok/s, {row['tokens_per_step']:.2f} tok/step")
            if progress:
                progress(1)
    return points


def infill_table(fc: FrontierConfig, models: dict, task_dir: str) -> list[dict]:
    from setdiff_mega.checkpoint import load_model
    from setdiff_mega.inference import GenerationConfig

    from .tasks import load_task, story_infill

    stories = load_task(task_dir, "stories", fc.infill_limit)
    rows = []
    for m in fc.methods:
        if m["objective"] == "mdlm":
            continue
        model, objective, tok, cfg = load_model(models[method_tag(m)])
        gc = GenerationConfig(max_new_tokens=fc.max_new_tokens, window=cfg.objective.D, tau=0.9,
                              block_size=m.get("block_size", 32))
        left_only = m["objective"] == "ar"
        r = story_infill(model, tok, m["objective"], stories, gc, cfg.data.seq_length, fc.batch_size,
                         left_only=left_only)
        rows.append({"method": method_label(m), "context": "left only" if left_only else "both sides",
                     "exact_match": r["exact_match"], "rouge_l": r["rouge_l"], "tokens_per_s": r["tokens_per_s"],
                     "n": r["n"]})
    return rows


def summarise(points: list[dict]) -> dict:
    """SetDLM's best tokens/s among points at least as accurate as BD3LM's best point (per metric)."""
    out = {}
    for metric in ("accuracy", "step_accuracy"):
        bd = [p for p in points if p["objective"] == "bd3lm"]
        sd = [p for p in points if p["objective"] == "setdlm"]
        if not bd or not sd:
            continue
        best = max(bd, key=lambda p: (p[metric], p["tokens_per_s"]))
        match = [p for p in sd if p[metric] >= best[metric]]
        entry = {"bd3lm_best": {k: best[k] for k in ("method", "tau", metric, "tokens_per_s")}}
        if match:
            fast = max(match, key=lambda p: p["tokens_per_s"])
            entry["setdlm_fastest_at_least_as_accurate"] = {k: fast.get(k) for k in ("method", "window", "tau", metric,
                                                                                     "tokens_per_s")}
            entry["speedup"] = fast["tokens_per_s"] / best["tokens_per_s"]
        else:
            entry["setdlm_fastest_at_least_as_accurate"] = None
        out[metric] = entry
    return out


def plot(points: list[dict], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), dpi=120)
    for ax, metric, name in ((axes[0], "accuracy", "math exact-match accuracy"),
                             (axes[1], "step_accuracy", "arithmetic-step accuracy")):
        for label in dict.fromkeys(p["method"] for p in points):
            sel = sorted((p for p in points if p["method"] == label), key=lambda p: p["tokens_per_s"])
            ax.plot([p["tokens_per_s"] for p in sel], [p[metric] for p in sel], "o-", lw=1.2, ms=4, label=label)
        ax.set_xlabel("decoding tokens/s (batch of 8, 2 CPU cores)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_title(title)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["FrontierConfig", "train_models", "evaluate_points", "infill_table", "summarise", "plot", "write_csv",
           "settings", "method_tag"]
