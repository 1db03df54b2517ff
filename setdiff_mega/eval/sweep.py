"""Scaling-law sweeps: a YAML grid -> one training run per point -> results CSV -> Chinchilla fit -> plot.

Grid file (see ``configs/sweeps/tiny.yaml``)::

    name: tiny                        # runs go to <out_dir>/runs/<run name>/
    out_dir: runs/sweeps/tiny
    base_config: configs/tiny_cpu.yaml
    overrides: [data.path=data/embedded/corpus, train.eval_iters=4]   # for every run
    objectives: [setdlm, ar]
    seeds: [0]
    models:                           # model sizes: ModelConfig fields
      - {num_layers: 2, hidden_size: 32, num_attention_heads: 2}
    tokens: [200000, 600000]          # training tokens per run (L-token samples x L), or
    isoflop: [3.0e12, 1.0e13]         # FLOP budgets: each model gets tokens = budget / FLOPs per token
    global_batch_size: 16             # samples per optimizer step (micro batch x accumulation x DP)
    micro_batch_size: 16
    data_parallel_size: 1             # processes per run (emit mode launches them with launch.sh)
    budget_flops: 1.0e15              # report the compute-optimal N and D for this budget

Every run gets its own resolved ``config.yaml`` in its directory (what the launch commands use). A
run's name encodes objective, model, tokens and seed; it is finished when its ``summary.json``
reaches its step count. ``run`` skips finished runs and resumes interrupted ones (the trainer's
``train.resume=auto``), so re-invoking a sweep is cheap and safe. ``emit`` writes ``commands.sh`` (one
``launch.sh`` line per run) and ``sweep.sbatch`` (a Slurm array over those lines) instead of running.
``collect`` gathers every finished run into ``results.csv`` with N (non-embedding parameters), D
(training tokens), FLOPs (:mod:`setdiff_mega.training.flops`: SetDLM and BD3LM process 2L positions per
L-token sample) and the final validation loss, fits L(N, D) per objective with bootstrap intervals
(:mod:`.scaling`), writes ``fit.json`` and plots loss against FLOPs with the fitted compute frontier
(``scaling.png``).
"""
from __future__ import annotations

import csv
import functools
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    name: str
    objective: str
    model: dict
    tokens: int
    seed: int
    steps: int
    overrides: list = field(default_factory=list)


class SweepError(ValueError):
    """A bad grid file; the message names the key."""


def load_grid(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise SweepError(f"sweep grid '{p}' does not exist (example: configs/sweeps/tiny.yaml)")
    grid = yaml.safe_load(p.read_text()) or {}
    for key in ("name", "base_config", "objectives", "models", "global_batch_size"):
        if key not in grid:
            raise SweepError(f"sweep grid '{p}' lacks '{key}'")
    if ("tokens" in grid) == ("isoflop" in grid):
        raise SweepError(f"sweep grid '{p}' needs exactly one of 'tokens' (per-run token budgets) or 'isoflop' "
                         f"(FLOP budgets)")
    try:      # YAML 1.1 reads 1.0e14 (no sign in the exponent) as a string
        for key in ("tokens", "isoflop"):
            if key in grid and grid[key] is not None:
                grid[key] = [float(x) for x in grid[key]]
        if grid.get("budget_flops") is not None:
            grid["budget_flops"] = float(grid["budget_flops"])
    except (TypeError, ValueError) as e:
        raise SweepError(f"sweep grid '{p}': token / FLOP budgets must be numbers ({e})") from None
    grid.setdefault("out_dir", f"runs/sweeps/{grid['name']}")
    grid.setdefault("seeds", [0])
    grid.setdefault("overrides", [])
    grid.setdefault("micro_batch_size", grid["global_batch_size"])
    grid.setdefault("data_parallel_size", 1)
    gb, mb, dp = grid["global_batch_size"], grid["micro_batch_size"], grid["data_parallel_size"]
    if gb % (mb * dp):
        raise SweepError(f"global_batch_size={gb} is not a multiple of micro_batch_size x data_parallel_size = "
                         f"{mb} x {dp}")
    return grid


def _load(grid, overrides=()):
    """The base config with the sweep's overrides, then ``overrides`` (a run's)."""
    from setdiff_mega.config import load_config

    base = grid["base_config"]
    return load_config(ROOT / base if not Path(base).is_absolute() else base, [*grid["overrides"], *overrides])


def _model_config(base, model: dict):
    import dataclasses

    return dataclasses.replace(base.model, **model)


@functools.lru_cache(maxsize=None)
def _tokenizer_vocab(path: str) -> int:
    from setdiff_mega.data.tokenizer import Tokenizer

    return Tokenizer.from_file(path).vocab_size


def flops_per_token(grid, model: dict, objective: str, base=None) -> float:
    """Training FLOPs per sample token of a model (same count as the trainer's MFU); ``base``: the grid's
    loaded base config, when the caller has it already."""
    from setdiff_mega.model.transformer import padded_vocab_size
    from setdiff_mega.training.flops import flops_per_sample

    base = _load(grid) if base is None else base
    mc = _model_config(base, model)
    tok_path = base.data.tokenizer or str(Path(base.data.path.split()[-1]).parent / "tokenizer.json")
    vocab = mc.vocab_size or _tokenizer_vocab(str(ROOT / tok_path if not Path(tok_path).is_absolute() else tok_path))
    L = base.data.seq_length
    return flops_per_sample(mc, padded_vocab_size(vocab, mc.make_vocab_size_divisible_by), objective, L) / L


def expand(grid) -> list[Run]:
    """Every (objective, model, budget, seed) point of the grid as a run."""
    base = _load(grid)
    L = base.data.seq_length
    gb, mb, dp = grid["global_batch_size"], grid["micro_batch_size"], grid["data_parallel_size"]
    runs = []
    for obj in grid["objectives"]:
        for model in grid["models"]:
            budgets = grid.get("tokens") or grid["isoflop"]
            for budget in budgets:
                tokens = int(budget) if "tokens" in grid else \
                    int(float(budget) / flops_per_token(grid, model, obj, base))
                steps = max(1, math.ceil(tokens / (gb * L)))
                for seed in grid["seeds"]:
                    tag = "_".join(f"{k[0]}{v}" for k, v in sorted(model.items()) if k != "num_attention_heads")
                    budget_tag = f"T{tokens}" if "tokens" in grid else f"C{float(budget):.1e}"
                    name = f"{obj}_{tag}_{budget_tag}_s{seed}".replace("+", "")
                    over = [f"objective.name={obj}", *(f"model.{k}={v}" for k, v in model.items()),
                            f"train.train_steps={steps}", f"train.micro_batch_size={mb}",
                            f"train.grad_accum_steps={gb // (mb * dp)}", f"train.seed={seed}",
                            f"train.save_dir={Path(grid['out_dir']) / 'runs' / name}"]
                    runs.append(Run(name, obj, dict(model), steps * gb * L, seed, steps, over))
    return runs


def run_dir(grid, run: Run) -> Path:
    return Path(grid["out_dir"]) / "runs" / run.name


def finished(grid, run: Run) -> dict | None:
    f = run_dir(grid, run) / "summary.json"
    if not f.is_file():
        return None
    try:
        s = json.loads(f.read_text())
    except json.JSONDecodeError:
        return None
    return s if s.get("final_step") == run.steps and not s.get("stopped_by") else None


def write_config(grid, run: Run) -> Path:
    """The run's fully resolved config (base + sweep overrides + run overrides) as YAML in its directory."""
    from setdiff_mega.config import dump_yaml

    cfg = _load(grid, run.overrides)
    d = run_dir(grid, run)
    d.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, d / "config.yaml")
    return d / "config.yaml"


def command(grid, run: Run, launcher: bool = False) -> list[str]:
    base = ["--config", str(write_config(grid, run))]
    if launcher or grid["data_parallel_size"] > 1:
        return ["bash", "launch.sh", "--nproc-per-node", str(grid["data_parallel_size"]), "--", *base]
    return [sys.executable, "-m", "setdiff_mega.train", *base]


def run_local(grid, runs: list[Run], log=print, env=None) -> dict:
    """Run unfinished runs one after another; returns {'ran': n, 'skipped': m, 'failed': [...]}."""
    from tqdm import tqdm

    todo = [r for r in runs if finished(grid, r) is None]
    skipped = len(runs) - len(todo)
    if skipped:
        log(f"skipping {skipped} finished run(s)")
    failed = []
    bar = tqdm(total=len(todo), desc=f"sweep {grid['name']}", unit="run", file=sys.stderr, dynamic_ncols=True)
    for r in todo:
        d = run_dir(grid, r)
        d.mkdir(parents=True, exist_ok=True)
        resume = (d / "checkpoints").is_dir()
        bar.set_postfix_str(f"{r.name}{' (resuming)' if resume else ''}")
        with open(d / "train.log", "a") as out:
            p = subprocess.run(command(grid, r), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        if p.returncode != 0 or finished(grid, r) is None:
            failed.append(r.name)
            log(f"run {r.name} failed (exit {p.returncode}); see {d / 'train.log'}")
        bar.update(1)
    bar.close()
    return {"ran": len(todo) - len(failed), "skipped": skipped, "failed": failed}


def emit(grid, runs: list[Run]) -> tuple[Path, Path]:
    """commands.sh (one launch line per unfinished run) and a Slurm array script over its lines."""
    out = Path(grid["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    todo = [r for r in runs if finished(grid, r) is None]
    lines = [shlex.join(command(grid, r, launcher=True)) for r in todo]
    cmds = out / "commands.sh"
    cmds.write_text("#!/bin/bash\n# one training run per line (run from the repository root)\n" + "\n".join(lines)
                    + "\n")
    sbatch = out / "sweep.sbatch"
    n = grid["data_parallel_size"]
    sbatch.write_text(f"""#!/bin/bash
#SBATCH --job-name=sweep-{grid['name']} --array=0-{max(len(lines) - 1, 0)} --nodes=1 --ntasks=1
#SBATCH --gpus-per-task={n} --cpus-per-task={8 * n} --signal=USR1@120 --requeue
# Each array task runs one line of commands.sh; re-submitting skips nothing by itself, but every run
# resumes from its newest checkpoint (train.resume=auto) and a finished run exits at once.
cd {ROOT}
line=$(grep -v '^#' {cmds.resolve()} | sed -n "$((SLURM_ARRAY_TASK_ID + 1))p")
eval "$line"
""")
    return cmds, sbatch


def collect(grid, runs: list[Run]) -> list[dict]:
    """One row per finished run: objective, N, D, FLOPs, final validation loss."""
    from setdiff_mega.training.flops import body_parameters

    base = _load(grid)
    rows = []
    for r in runs:
        s = finished(grid, r)
        if s is None:
            continue
        mc = _model_config(base, r.model)
        fpt = flops_per_token(grid, r.model, r.objective, base)
        rows.append({"run": r.name, "objective": r.objective, "seed": r.seed, **{f"model.{k}": v for k, v in
                                                                                  r.model.items()},
                     "N": body_parameters(mc), "N_total": s.get("num_parameters"), "D": r.tokens,
                     "flops": fpt * r.tokens, "flops_per_token": fpt, "val_loss": s["final_val_loss"],
                     "steps": r.steps})
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def fit_all(rows: list[dict], budget: float | None, n_boot: int = 200) -> dict:
    """Per objective: the fit, bootstrap intervals, FLOPs per parameter-token, compute-optimal N and D."""
    import numpy as np

    from .scaling import bootstrap, fit_chinchilla

    out = {}
    for obj in sorted({r["objective"] for r in rows}):
        sel = [r for r in rows if r["objective"] == obj]
        if len(sel) < 5:
            out[obj] = {"error": f"{len(sel)} finished runs; a fit needs at least 5"}
            continue
        N, D, L = (np.array([r[k] for r in sel], dtype=float) for k in ("N", "D", "val_loss"))
        f = fit_chinchilla(N, D, L)
        c = float(np.median([r["flops"] / (r["N"] * r["D"]) for r in sel]))
        res = {"fit": f.to_dict(), "ci90": bootstrap(N, D, L, n_boot=n_boot), "flops_per_param_token": c,
               "runs": len(sel)}
        if budget:
            n_opt, d_opt = f.optimal(budget, c)
            res["budget_flops"] = budget
            res["optimal"] = {"N": n_opt, "D": d_opt, "tokens_per_param": d_opt / n_opt,
                              "loss": float(f.predict(n_opt, d_opt))}
        out[obj] = res
    return out


def plot(rows: list[dict], fits: dict, path: Path, title: str = "") -> Path:
    """Validation loss against training FLOPs, one colour per objective, marker size by model size, and
    the fitted compute-optimal frontier L(N_opt(C), D_opt(C))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from .scaling import ScalingFit

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, obj in enumerate(sorted({r["objective"] for r in rows})):
        sel = [r for r in rows if r["objective"] == obj]
        col = colours[i % len(colours)]
        sizes = np.array([r["N"] for r in sel], dtype=float)
        ax.scatter([r["flops"] for r in sel], [r["val_loss"] for r in sel], s=20 + 80 * sizes / sizes.max(),
                   color=col, alpha=0.8, label=f"{obj} runs")
        fit = fits.get(obj, {}).get("fit")
        if fit:
            f = ScalingFit(**fit)
            c = fits[obj]["flops_per_param_token"]
            lo, hi = min(r["flops"] for r in sel), max(r["flops"] for r in sel)
            C = np.logspace(math.log10(lo) - 0.3, math.log10(hi) + 0.5, 60)
            frontier = [float(f.predict(*f.optimal(x, c))) for x in C]
            ax.plot(C, frontier, color=col, lw=1.5,
                    label=f"{obj} fit: E={f.E:.2f}, alpha={f.alpha:.2f}, beta={f.beta:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["load_grid", "expand", "write_config", "run_local", "emit", "collect", "fit_all", "plot", "write_csv", "Run",
           "SweepError", "flops_per_token"]
