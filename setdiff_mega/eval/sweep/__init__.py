"""Scaling-law sweeps: a YAML grid -> one training run per point -> results CSV -> Chinchilla fit -> plot.

Three steps and a comparison, four modules: :mod:`.grid` (the typed, validated grid and its plan: one :class:`Run` per
point, FLOPs per token), :mod:`.execute` (resolved configs, commands, running locally or emitting a
Slurm array), :mod:`.report` (results rows, CSV, fits, the loss-vs-FLOPs plot) and :mod:`.compare` (compute
multipliers between objectives at equal loss, held-out predictions).
"""
from .compare import multipliers, predict
from .execute import command, emit, finished, run_local, write_config
from .grid import Run, SweepError, SweepGrid, expand, flops_per_token, holdout_runs, load_grid, load_run_config
from .report import collect, fit_all, plot, write_csv

__all__ = ["load_grid", "expand", "write_config", "command", "run_local", "emit", "finished", "collect", "fit_all",
           "plot", "write_csv", "multipliers", "predict", "holdout_runs", "Run", "SweepGrid", "SweepError",
           "flops_per_token", "load_run_config"]
