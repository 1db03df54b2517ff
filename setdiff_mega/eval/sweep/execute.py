"""Executing a sweep's plan: each run's resolved config, its command, running them here or emitting them
for a cluster.

Every run gets its own resolved ``config.yaml`` in its directory (what the launch commands use). A run
is finished when its ``summary.json`` reaches its step count. :func:`run_local` skips finished runs and
resumes interrupted ones (the trainer's ``train.resume=auto``), so re-invoking a sweep is cheap and
safe; SIGTERM / SIGINT reach the run in progress, which saves and stops, and no other run starts. It
launches ``python -m setdiff_mega.train`` (the package's entry point, from the working directory) or, for
several processes per run, ``launch.sh``. :func:`emit` writes ``commands.sh`` (one ``launch.sh`` line per
unfinished run) and ``sweep.sbatch`` (a Slurm array over those lines) instead.
"""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from setdiff_mega.config import dump_yaml

from .grid import Run, SweepGrid, load_run_config


def finished(grid: SweepGrid, run: Run) -> dict | None:
    f = grid.run_dir(run) / "summary.json"
    if not f.is_file():
        return None
    try:
        s = json.loads(f.read_text())
    except json.JSONDecodeError:
        return None
    return s if s.get("final_step") == run.steps and not s.get("stopped_by") else None


def write_config(grid: SweepGrid, run: Run) -> Path:
    """The run's fully resolved config (base + sweep overrides + run overrides) as YAML in its directory."""
    cfg = load_run_config(grid, run.overrides)
    d = grid.run_dir(run)
    d.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, d / "config.yaml")
    return d / "config.yaml"


CLUSTER_RESTARTS = 2    # emitted cluster lines restart a crashed or hung run in place (docs/guide/multinode.md)


def command(grid: SweepGrid, run: Run, launcher: bool = False) -> list[str]:
    base = ["--config", str(write_config(grid, run))]
    if launcher:
        return ["bash", "launch.sh", "--nproc-per-node", str(grid.data_parallel_size), "--max-restarts",
                str(CLUSTER_RESTARTS), "--", *base]
    if grid.data_parallel_size > 1:
        return ["bash", "launch.sh", "--nproc-per-node", str(grid.data_parallel_size), "--", *base]
    return [sys.executable, "-m", "setdiff_mega.train", *base]


def run_local(grid: SweepGrid, runs: list[Run], log=print, env=None) -> dict:
    """Run unfinished runs one after another; returns {'ran': n, 'skipped': m, 'failed': [...], 'interrupted':
    bool}. SIGTERM or SIGINT reaches the run in progress as SIGTERM (the trainer saves a checkpoint and stops) and
    no further run starts: invoking the sweep again skips the finished runs and resumes the stopped one."""
    todo = [r for r in runs if finished(grid, r) is None]
    skipped = len(runs) - len(todo)
    if skipped:
        log(f"skipping {skipped} finished run(s)")
    failed, state = [], {"proc": None, "signal": None}

    def forward(signum, _frame):
        state["signal"] = signum
        if state["proc"] is not None and state["proc"].poll() is None:      # as SIGTERM: a Ctrl-C in a terminal
            state["proc"].send_signal(signal.SIGTERM)                       # reaches the trainer too, and a
                                                                            # second SIGINT would abort unsaved
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    bar = tqdm(total=len(todo), desc=f"sweep {grid.name}", unit="run", file=sys.stderr, dynamic_ncols=True)
    try:
        for r in todo:
            if state["signal"] is not None:
                break
            d = grid.run_dir(r)
            d.mkdir(parents=True, exist_ok=True)
            resume = (d / "checkpoints").is_dir()
            bar.set_postfix_str(f"{r.name}{' (resuming)' if resume else ''}")
            with open(d / "train.log", "a") as out:
                state["proc"] = subprocess.Popen(command(grid, r), stdout=out, stderr=subprocess.STDOUT, env=env)
                code = state["proc"].wait()
            if state["signal"] is not None:
                log(f"stopped by signal {state['signal']}: {r.name} saved at its last step; run the sweep again to "
                    f"resume it and the {len(todo) - bar.n - 1} run(s) after it")
                break
            if code != 0 or finished(grid, r) is None:
                failed.append(r.name)
                log(f"run {r.name} failed (exit {code}); see {d / 'train.log'}")
            bar.update(1)
    finally:
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
    return {"ran": bar.n - len(failed), "skipped": skipped, "failed": failed,
            "interrupted": state["signal"] is not None}


def emit(grid: SweepGrid, runs: list[Run]) -> tuple[Path, Path]:
    """commands.sh (one launch line per unfinished run) and a Slurm array script over its lines."""
    out = Path(grid.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    todo = [r for r in runs if finished(grid, r) is None]
    lines = [shlex.join(command(grid, r, launcher=True)) for r in todo]
    cmds = out / "commands.sh"
    cmds.write_text("#!/bin/bash\n# one training run per line (run from the directory the sweep was planned in)\n"
                    + "\n".join(lines) + "\n")
    sbatch = out / "sweep.sbatch"
    n = grid.data_parallel_size
    sbatch.write_text(f"""#!/bin/bash
#SBATCH --job-name=sweep-{grid.name} --array=0-{max(len(lines) - 1, 0)} --nodes=1 --ntasks=1
#SBATCH --gpus-per-task={n} --cpus-per-task={8 * n} --signal=USR1@120 --requeue
# Each array task runs one line of commands.sh (restarted in place after a crash or a hung rank, up to
# {CLUSTER_RESTARTS} times); re-submitting skips nothing by itself, but every run resumes from its newest checkpoint
# (train.resume=auto) and a finished run exits at once.
cd {Path.cwd()}
line=$(grep -v '^#' {cmds.resolve()} | sed -n "$((SLURM_ARRAY_TASK_ID + 1))p")
eval "$line"
""")
    return cmds, sbatch


__all__ = ["finished", "write_config", "command", "run_local", "emit"]
