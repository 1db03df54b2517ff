"""A sweep's grid, typed and validated, and its plan: grid -> one :class:`Run` per point.

Grid file (see ``configs/sweeps/tiny.yaml``)::

    name: tiny                        # runs go to <out_dir>/runs/<run name>/
    out_dir: runs/sweeps/tiny
    base_config: configs/tiny_cpu.yaml
    overrides: [data.path=data/embedded/corpus, train.eval_iters=4]   # for every run
    objectives: [setdlm, ar]          # names, or {name: bd3lm, block_size: 4}: objective fields of the variant
    seeds: [0]
    extra_seeds:                      # more seeds at chosen points (seed noise): indices into models / budgets
      - {objective: setdlm, model: 1, budget: 1, seeds: [1, 2]}
    holdout:                          # one larger run per objective, predicted by the fit before it is trained
      model: {num_layers: 6, hidden_size: 192, num_attention_heads: 6}
      tokens: 3200000
    models:                           # model sizes: ModelConfig fields
      - {num_layers: 2, hidden_size: 32, num_attention_heads: 2}
    tokens: [200000, 600000]          # training tokens per run (L-token samples x L), or
    isoflop: [3.0e12, 1.0e13]         # FLOP budgets: each model gets tokens = budget / FLOPs per token
    global_batch_size: 16             # samples per optimizer step (micro batch x accumulation x DP)
    micro_batch_size: 16
    data_parallel_size: 1             # processes per run (emit mode launches them with launch.sh)
    budget_flops: 1.0e15              # report the compute-optimal N and D for this budget

Relative paths (the grid's ``base_config``, the data and tokenizer paths inside the configs) are
resolved against the working directory, as the trainer resolves them, and the runs are launched from
it. A run's name encodes objective, model, tokens and seed; its step count is the token budget rounded
up to whole global batches. FLOPs per token are the trainer's (:mod:`setdiff_mega.training.flops`:
SetDLM and BD3LM process 2L positions per L-token sample), with the vocabulary of the tokenizer the
trainer would use (:func:`setdiff_mega.build.tokenizer_for`, blends included).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

from setdiff_mega.build import tokenizer_path
from setdiff_mega.config import load_config
from setdiff_mega.config.yamlfile import read_yaml
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.model.transformer import padded_vocab_size
from setdiff_mega.training.flops import flops_per_sample


class SweepError(ValueError):
    """A bad grid file; the message names the key."""


@dataclass
class Run:
    name: str
    objective: str                  # the objective variant's label (grouping, fits): "ar", "bd3lm-block_size4"
    model: dict
    tokens: int
    seed: int
    steps: int
    overrides: list = field(default_factory=list)
    method: str = ""                # the objective's name (FLOPs per token)

    def __post_init__(self):
        self.method = self.method or self.objective


@dataclass
class SweepGrid:
    name: str
    base_config: str
    objectives: list
    models: list
    global_batch_size: int
    tokens: list | None = None
    isoflop: list | None = None
    out_dir: str = ""
    seeds: list = field(default_factory=lambda: [0])
    overrides: list = field(default_factory=list)
    micro_batch_size: int | None = None
    data_parallel_size: int = 1
    budget_flops: float | None = None
    extra_seeds: list = field(default_factory=list)
    holdout: dict | None = None
    source: str = ""

    def __post_init__(self):
        src = f"sweep grid '{self.source}'"
        if self.holdout is not None and (not isinstance(self.holdout, dict) or set(self.holdout) !=
                                         {"model", "tokens"} or not isinstance(self.holdout["model"], dict)):
            raise SweepError(f"{src}: holdout is {{model: {{ModelConfig fields}}, tokens: N}}, got {self.holdout}")
        if (self.tokens is None) == (self.isoflop is None):
            raise SweepError(f"{src} needs exactly one of 'tokens' (per-run token budgets) or 'isoflop' "
                             f"(FLOP budgets)")
        try:      # YAML 1.1 reads 1.0e14 (no sign in the exponent) as a string
            self.tokens = None if self.tokens is None else [float(x) for x in self.tokens]
            self.isoflop = None if self.isoflop is None else [float(x) for x in self.isoflop]
            self.budget_flops = None if self.budget_flops is None else float(self.budget_flops)
        except (TypeError, ValueError) as e:
            raise SweepError(f"{src}: token / FLOP budgets must be numbers ({e})") from None
        self.out_dir = self.out_dir or f"runs/sweeps/{self.name}"
        self.objectives = [_variant(o, src) for o in self.objectives]
        labels = [o["label"] for o in self.objectives]
        for e in self.extra_seeds:
            if not isinstance(e, dict) or set(e) != {"objective", "model", "budget", "seeds"}:
                raise SweepError(f"{src}: each extra_seeds entry is {{objective, model, budget, seeds}}, got {e}")
            if e["objective"] not in labels or not 0 <= e["model"] < len(self.models) or \
                    not 0 <= e["budget"] < len(self.tokens if self.tokens is not None else self.isoflop):
                raise SweepError(f"{src}: extra_seeds entry {e} names no point of the grid (objective one of "
                                 f"{labels}; model and budget are 0-based indices into models and the budgets)")
        self.micro_batch_size = self.micro_batch_size or self.global_batch_size
        gb, mb, dp = self.global_batch_size, self.micro_batch_size, self.data_parallel_size
        if gb % (mb * dp):
            raise SweepError(f"global_batch_size={gb} is not a multiple of micro_batch_size x data_parallel_size = "
                             f"{mb} x {dp}")

    @property
    def accumulation(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def budgets(self) -> list:
        return self.tokens if self.tokens is not None else self.isoflop

    def run_dir(self, run: Run) -> Path:
        return Path(self.out_dir) / "runs" / run.name


REQUIRED = ("name", "base_config", "objectives", "models", "global_batch_size")


def load_grid(path: str | Path) -> SweepGrid:
    p = Path(path)
    if not p.is_file():
        raise SweepError(f"sweep grid '{p}' does not exist (example: configs/sweeps/tiny.yaml)")
    raw = read_yaml(p, "sweep grid", SweepError) or {}
    for key in REQUIRED:
        if key not in raw:
            raise SweepError(f"sweep grid '{p}' lacks '{key}'")
    known = {f.name for f in dataclasses.fields(SweepGrid)} - {"source"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SweepError(f"sweep grid '{p}' has unknown keys {unknown}; keys: {', '.join(sorted(known))}")
    return SweepGrid(**raw, source=str(p))


def load_run_config(grid: SweepGrid, overrides=()):
    """The base config with the sweep's overrides, then ``overrides`` (a run's)."""
    return load_config(grid.base_config, [*grid.overrides, *overrides])


@functools.lru_cache(maxsize=None)
def _vocab(tokenizer_path: str) -> int:
    return Tokenizer.from_file(tokenizer_path).vocab_size


def flops_per_token(grid: SweepGrid, model: dict, objective: str, base=None) -> float:
    """Training FLOPs per sample token of a model (the trainer's count); ``base``: the grid's loaded
    base config, when the caller has it already."""
    base = load_run_config(grid) if base is None else base
    mc = dataclasses.replace(base.model, **model)
    vocab = mc.vocab_size or _vocab(tokenizer_path(base))
    L = base.data.seq_length
    return flops_per_sample(mc, padded_vocab_size(vocab, mc.make_vocab_size_divisible_by), objective, L) / L


def _variant(obj, src: str) -> dict:
    """An ``objectives`` entry -> {"name", "fields", "label"}: a name alone, or a mapping with ``name`` and the
    objective's fields (the label appends them: ``bd3lm-block_size4``)."""
    if isinstance(obj, str):
        return {"name": obj, "fields": {}, "label": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise SweepError(f"{src}: an objective is a name or a mapping with 'name' (and objective fields), got {obj}")
    fields = {k: v for k, v in obj.items() if k != "name"}
    return {"name": obj["name"], "fields": fields,
            "label": "-".join([obj["name"], *(f"{k}{v}" for k, v in sorted(fields.items()))])}


def _run_name(obj: str, model: dict, budget_tag: str, seed: int) -> str:
    tag = "_".join(f"{k[0]}{v}" for k, v in sorted(model.items()) if k != "num_attention_heads")
    return f"{obj}_{tag}_{budget_tag}_s{seed}".replace("+", "")


def expand(grid: SweepGrid) -> list[Run]:
    """Every (objective, model, budget, seed) point of the grid as a run (the plan), then ``extra_seeds``."""
    base = load_run_config(grid)
    runs = []
    for obj in grid.objectives:
        for mi, model in enumerate(grid.models):
            for bi, budget in enumerate(grid.budgets):
                extra = [s for e in grid.extra_seeds if (e["objective"], e["model"], e["budget"]) ==
                         (obj["label"], mi, bi) for s in e["seeds"]]
                for seed in [*grid.seeds, *(s for s in extra if s not in grid.seeds)]:
                    runs.append(_run(grid, base, obj, model, budget, grid.tokens is not None, seed))
    return runs


def holdout_runs(grid: SweepGrid) -> list[Run]:
    """The grid's held-out point, one run per objective (first seed), named ``holdout_<run name>``; [] without."""
    if grid.holdout is None:
        return []
    base, model = load_run_config(grid), dict(grid.holdout["model"])
    return [_run(grid, base, obj, model, float(grid.holdout["tokens"]), True, grid.seeds[0], prefix="holdout_")
            for obj in grid.objectives]


def _run(grid: SweepGrid, base, obj: dict, model: dict, budget, in_tokens: bool, seed: int, prefix: str = "") -> Run:
    """One run; ``budget`` in tokens (``in_tokens``) or in FLOPs (an IsoFLOP budget)."""
    L, gb = base.data.seq_length, grid.global_batch_size
    tokens = int(budget) if in_tokens else int(float(budget) / flops_per_token(grid, model, obj["name"], base))
    steps = max(1, math.ceil(tokens / (gb * L)))
    budget_tag = f"T{tokens}" if in_tokens else f"C{float(budget):.1e}"
    name = prefix + _run_name(obj["label"], model, budget_tag, seed)
    over = [f"objective.name={obj['name']}", *(f"objective.{k}={v}" for k, v in obj["fields"].items()),
            *(f"model.{k}={v}" for k, v in model.items()),
            f"train.train_steps={steps}", f"train.micro_batch_size={grid.micro_batch_size}",
            f"train.grad_accum_steps={grid.accumulation}", f"train.seed={seed}",
            f"train.save_dir={Path(grid.out_dir) / 'runs' / name}"]
    return Run(name, obj["label"], dict(model), steps * gb * L, seed, steps, over, method=obj["name"])


__all__ = ["SweepGrid", "SweepError", "Run", "load_grid", "load_run_config", "flops_per_token", "expand",
           "holdout_runs"]
