"""Metric sinks: console (tqdm), metrics.jsonl, wandb (offline by default), TensorBoard event files
(``logging.tensorboard``, in ``<save_dir>/tensorboard``) and the loss-curve PNG; and the peak memory of a
rank (:func:`peak_memory_bytes`: CUDA max allocated on a GPU, the process's peak RSS on CPU)."""
from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch
from tqdm import tqdm


class MetricLogger:
    """Fan metrics out to the progress bar, a JSONL file and wandb; owns the tqdm bar."""

    def __init__(self, save_dir: Path, total_steps: int, initial_step: int, lc, config_dict: dict,
                 enabled: bool = True, resume_step: int | None = None, log_interval: int = 1):
        self.enabled = enabled
        self.total_steps, self.log_interval = total_steps, max(1, int(log_interval))
        self.history: list[dict] = []
        self.jsonl = None
        self.bar = None
        self.wandb_run = None
        self.tb = None
        if not enabled:
            return
        save_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self.history = truncate_metrics(save_dir / "metrics.jsonl", resume_step)
        if lc.jsonl:
            self.jsonl = open(save_dir / "metrics.jsonl", "a", encoding="utf-8")
        if lc.progress:
            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
        if lc.wandb != "disabled":
            try:
                import wandb  # gated: only when logging.wandb is not disabled (slow to import)

                os.environ.setdefault("WANDB_SILENT", "true")
                self.wandb_run = wandb.init(project=lc.project, name=lc.run_name, mode=lc.wandb,
                                            dir=str(save_dir), config=config_dict, reinit="finish_previous")
            except Exception as e:  # never let experiment tracking kill a training run
                self.write(f"wandb disabled ({type(e).__name__}: {e})")
        if lc.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # gated: logging.tensorboard only

            self.tb = SummaryWriter(log_dir=str(save_dir / "tensorboard"), purge_step=resume_step)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        (self.bar.write if self.bar is not None else print)(line)

    def due(self, step: int) -> bool:
        """Training metrics are logged after ``step`` (every ``train.log_interval`` steps and the last);
        the same answer on every rank."""
        return step % self.log_interval == 0 or step == self.total_steps

    def log(self, metrics: dict, step: int) -> None:
        rec = {"step": step, **{k: (float(v) if hasattr(v, "__float__") else v) for k, v in metrics.items()}}
        self.history.append(rec)
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(rec) + "\n")
            self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def advance(self, n: int = 1, postfix: dict | None = None) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        """Close every sink (idempotent)."""
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tb is not None:
            self.tb.close()
        self.bar = self.jsonl = self.wandb_run = self.tb = None


def peak_memory_bytes() -> int:
    """This process's peak memory: CUDA max allocated on a GPU, else the peak resident set size."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024      # Linux reports KiB


def truncate_metrics(path: Path, step: int) -> list[dict]:
    """Keep the records of steps <= ``step`` (a resumed run rewrites what came after its checkpoint);
    returns them. Unparseable lines (a crash mid-write) are dropped."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("step", step + 1) <= step:
            kept.append(rec)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
    return kept


def plot_loss_curve(history: list[dict], path: Path, title: str = "") -> Path | None:
    """Train and validation loss against step -> PNG."""
    import matplotlib  # gated: the backend is chosen before pyplot is imported (headless machines)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["train/loss"]) for r in history if "train/loss" in r]
    val = [(r["step"], r["val/loss"]) for r in history if "val/loss" in r]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["MetricLogger", "plot_loss_curve", "truncate_metrics", "peak_memory_bytes"]
