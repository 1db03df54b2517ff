"""The planning study's plan (issue 56): which tasks at which difficulties, which methods, seeds and training
budget, and the arithmetic that makes the budget equal.

**Models.** Every method trains the same transformer (the task's base config under ``configs/planning/``: its
shape, the vocabulary with the MASK row, the sequence length), so parameter counts are equal by construction; the
report prints each run's count from its summary.

**Equal training FLOPs.** Per L-token sample the model processes T positions and puts logits on N of them
(:func:`setdiff_mega.training.flops.flops_per_sample`: AR T = N = L - 1; MDLM T = N = L; BD3LM and SetDLM T = 2L,
N = L). With the micro-batch fixed, method m trains

    steps(m) = round(reference_steps * F(reference) / F(m))        F: forward + backward FLOPs per sample

so every method spends the FLOPs that ``reference_steps`` steps of the reference method (AR) spend: the 2L
methods see about half as many samples. The report states both the parameters and the FLOPs of each run.

**Budget** (:func:`budget`, ``tools/reproduce.py --planning --dry-run``). A training step of ``micro_batch``
samples costs ``STEP_OVERHEAD_S + S_PER_FLOP * micro_batch * F(m, L)`` seconds, the two constants fitted on AR and
SetDLM at L = 36 and 168 on this 2-core machine (measured 2026-12-07, within 10 % of all four points). Decoding is
estimated, not measured: ``FORWARD_S`` per batched forward, an answer of about L / 2 tokens, one token per forward
(two for k = 2 or a tau < 1e6 policy); dev decodes every policy at every eval level, test the chosen one, the speed
``speed_limit`` problems at batch 1.

**Difficulty.** One model per (task, method, seed) trains on a mixture of the task's ``train_knobs`` levels (the
train splits of every level, :mod:`.data`); it is scored at every level of ``eval_knobs`` (each level's own dev
and test splits), which draws the difficulty curve. Splits are assigned by a hash of each problem's computation
whatever the knob (``setdiff_mega/tasks/splits.py``), so no level's training data holds another level's test
problem.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from setdiff_mega.config import load_config
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.tasks import knob_tag
from setdiff_mega.training.flops import flops_per_sample

STEP_OVERHEAD_S = 0.019       # s per training step besides the FLOPs (fitted, module docstring)
S_PER_FLOP = 1.04e-11         # s per training FLOP (forward + backward) on 2 idle cores (fitted)
FORWARD_S = 0.05              # assumed s per batched decoding forward of these models (not measured)
BATCH1_FORWARD_S = 0.01       # assumed s per batch-1 decoding forward (not measured)

METHODS = ({"objective": "ar"}, {"objective": "mdlm"}, {"objective": "bd3lm", "block_size": 4},
           {"objective": "setdlm", "D": 4})


@dataclass
class TaskPlan:
    task: str                          # setdiff_mega.tasks registry name
    config: str                        # base config (configs/planning/<task>.yaml): model, L, batch, lr
    curve: str                         # the knob the difficulty curve varies
    train_knobs: list                  # the levels whose train splits are mixed into one training set
    eval_knobs: list                   # the levels scored (their dev and test splits)
    num_train: int = 20000             # problems per training level
    num_dev: int = 256                 # per level: settings are chosen here
    num_test: int = 512                # per level: reported once, for the chosen settings
    reference_steps: int | None = None # the reference method's steps (None: PlanningConfig.reference_steps)

    def levels(self) -> list[dict]:
        """Every level this task needs data for, train levels first, each once."""
        out = []
        for k in [*self.train_knobs, *self.eval_knobs]:
            if k not in out:
                out.append(dict(k))
        return out


def default_tasks() -> list[TaskPlan]:
    return [
        TaskPlan("sudoku4", "configs/planning/sudoku4.yaml", "givens",
                 [{"givens": g} for g in (4, 6, 8)], [{"givens": g} for g in (4, 6, 8, 10)]),
        TaskPlan("sudoku9", "configs/planning/sudoku9.yaml", "givens",
                 [{"givens": g} for g in (30, 36, 42)], [{"givens": g} for g in (28, 32, 36, 42)],
                 num_train=10000, reference_steps=1000),
        TaskPlan("countdown", "configs/planning/countdown.yaml", "operands",
                 [{"operands": n} for n in (3, 4)], [{"operands": n} for n in (3, 4, 5)]),
        TaskPlan("multiplication", "configs/planning/multiplication.yaml", "digits",
                 [{"digits": d} for d in (2, 3, 4)], [{"digits": d} for d in (2, 3, 4)]),
        TaskPlan("pathstar", "configs/planning/pathstar.yaml", "degree",
                 [{"degree": d} for d in (2, 3, 4)], [{"degree": d} for d in (2, 3, 4, 5)]),
    ]


@dataclass
class PlanningConfig:
    out_dir: str = "runs/planning"
    tasks: list = field(default_factory=default_tasks)
    methods: list = field(default_factory=lambda: [dict(m) for m in METHODS])
    seeds: list = field(default_factory=lambda: [1234, 7, 42])
    reference: str = "ar"              # equal FLOPs: every method spends what reference_steps of this one spend
    reference_steps: int = 2000
    overrides: list = field(default_factory=lambda: ["logging.wandb=disabled", "logging.progress=false"])
    data_seed: int = 0
    eval_batch: int = 64
    speed_limit: int = 32              # problems timed at batch 1 per chosen setting (fp32-packed)
    decode_weights: str = "fp32-packed"
    only: list | None = None           # run only these task names (the others keep their cached results)

    def selected(self) -> list[TaskPlan]:
        return [t for t in self.tasks if not self.only or t.task in self.only]


def toy_config(out_dir: str) -> PlanningConfig:
    """A minutes-sized run with the full structure (the tests): 4x4 Sudoku at two levels, every method, one seed,
    a few steps, a handful of problems."""
    tasks = [TaskPlan("sudoku4", "configs/planning/sudoku4.yaml", "givens", [{"givens": 8}], [{"givens": 6},
                      {"givens": 8}], num_train=300, num_dev=12, num_test=12)]
    return PlanningConfig(out_dir=out_dir, tasks=tasks, seeds=[1234], reference_steps=6, eval_batch=16,
                          speed_limit=2, overrides=["logging.wandb=disabled", "logging.progress=false",
                                                    "train.eval_interval=3", "train.eval_iters=1",
                                                    "train.micro_batch_size=8", "data.split=90,10,0"])


def level_tag(knob: dict) -> str:
    return knob_tag(knob)


def equal_flops_steps(pc: PlanningConfig, tp: TaskPlan, tokenizer: Tokenizer, L: int | None = None) -> dict:
    """{method key: (steps, FLOPs per sample)} at equal training FLOPs (module docstring); the FLOPs use the task
    config's model at length ``L`` (default: the config's), the vocabulary padded as the model pads it."""
    cfg = load_config(tp.config)
    mc, L = cfg.model, L or cfg.data.seq_length
    div = mc.make_vocab_size_divisible_by
    padded = -(-tokenizer.vocab_size // div) * div
    per = {method_key(m): flops_per_sample(mc, padded, m["objective"], L) for m in pc.methods}
    ref = flops_per_sample(mc, padded, pc.reference, L)
    steps = tp.reference_steps or pc.reference_steps
    return {k: (max(1, round(steps * ref / f)), f) for k, f in per.items()}


def task_tokenizer() -> Tokenizer:
    """The character vocabulary every task's grid layout uses (what :mod:`.data` writes), without drawing data."""
    from setdiff_mega.tasks import CHARACTERS, SEP
    return Tokenizer.characters(CHARACTERS, (SEP,))


def budget(pc: PlanningConfig) -> dict:
    """Estimated seconds per (task, method, seed) (module docstring) and the total."""
    from .policies import policies
    tok, rows = task_tokenizer(), []
    for tp in pc.selected():
        cfg = load_config(tp.config)
        L, mb = cfg.data.seq_length, cfg.train.micro_batch_size
        answer = max(1, L // 2)
        for key, (steps, flops) in equal_flops_steps(pc, tp, tok, L).items():
            m = next(x for x in pc.methods if method_key(x) == key)
            train = steps * (STEP_OVERHEAD_S + S_PER_FLOP * mb * flops)
            per = [answer / (1 if p["options"]["tau"] >= 1e6 and p["options"].get("commit_k", 1) == 1 else 2)
                   for p in policies(m, answer + 1)]
            levels = len(tp.eval_knobs)
            dev = levels * math.ceil(tp.num_dev / pc.eval_batch) * sum(per) * FORWARD_S
            test = levels * math.ceil(tp.num_test / pc.eval_batch) * max(per) * FORWARD_S
            speed = levels * pc.speed_limit * max(per) * BATCH1_FORWARD_S
            for seed in pc.seeds:
                rows.append({"task": tp.task, "method": key, "seed": seed, "steps": steps, "L": L,
                             "train_s": train, "eval_s": dev + test + speed, "total_s": train + dev + test + speed})
    return {"rows": rows, "total_s": sum(r["total_s"] for r in rows),
            "longest_s": max((r["total_s"] for r in rows), default=0.0)}


def describe(pc: PlanningConfig) -> list[str]:
    """The dry run's lines: every task's levels, every (method, seed) with its steps at equal FLOPs, the budget."""
    b = budget(pc)
    lines = [f"out: {pc.out_dir}; seeds {', '.join(map(str, pc.seeds))}; equal training FLOPs: "
             f"{pc.reference} at each task's reference steps"]
    for tp in pc.selected():
        lines.append(f"task {tp.task} ({tp.config}): trains on {', '.join(map(level_tag, tp.train_knobs))}; curve "
                     f"over {tp.curve} at {', '.join(map(level_tag, tp.eval_knobs))}; {tp.num_train} train problems "
                     f"per level, {tp.num_dev} dev / {tp.num_test} test per level")
    for r in b["rows"]:
        lines.append(f"  {r['task']:<15} {r['method']:<10} s{r['seed']:<5} {r['steps']:>5} steps at L={r['L']}: "
                     f"train {r['train_s'] / 60:5.1f} min, decode {r['eval_s'] / 60:4.1f} min")
    lines.append(f"budget: {b['total_s'] / 3600:.1f} h on 2 idle cores; the longest (task, method, seed) "
                 f"{b['longest_s'] / 60:.1f} min (training: {STEP_OVERHEAD_S:g} s + {S_PER_FLOP:.3g} s/FLOP per "
                 f"step, fitted; decoding {FORWARD_S:g} s per batched forward, assumed)")
    return lines


def method_key(m: dict) -> str:
    """'ar', 'mdlm', 'bd3lm_S4', 'setdlm_D4' (no seed)."""
    extra = "".join(f"_{'S' if k == 'block_size' else k}{v}" for k, v in sorted(m.items())
                    if k not in ("objective", "seed"))
    return f"{m['objective']}{extra}"


__all__ = ["METHODS", "TaskPlan", "PlanningConfig", "default_tasks", "toy_config", "equal_flops_steps", "method_key",
           "level_tag", "task_tokenizer", "budget", "describe", "STEP_OVERHEAD_S", "S_PER_FLOP", "FORWARD_S"]
