"""The conversion study (issue 55, ``tools/reproduce.py --convert``): SmolLM2-135M-Instruct converted into AR,
BD3LM (S = 4) and SetDLM (D = 4) children by fine-tuning, against its own AR fine-tune, on tasks that do not
saturate.

For each selected task (:mod:`.plan`):

1. **parent**: imported once (:func:`.train.import_parent`); its held-out NLL and its greedy test exact match are
   points of the arm ``parent``;
2. **calibration** (dev only): the AR fine-tune of the first seed on the ladder's rungs until its dev exact match
   lands in the band (:func:`.plan.calibration_step`); every tried rung is recorded;
3. **arms** on the chosen knob, every seed: the training point (validation loss), every dev setting's accuracy,
   the held-out NLL;
4. **roles** on the dev seed means (:func:`.evaluate.roles`) and each arm's chosen settings decoded **once** on
   test (nothing else touches test);
5. **timings** (unless ``timings=False``): the chosen settings at batch 1 on the first ``speed_limit`` test
   problems, ``fp32-packed``, the first seed's model of each arm, after everything else. Never cached.

Every point goes through the committed point store (:mod:`.points`): a re-run, here or on a machine where the
models are gone, reuses every point whose key and code match and trains only the children a missing point needs
(a child is trained, or its run directory reused, only when one of its points is missing). With ``compute=False``
(the timings-only report run, or arms the filters leave out) nothing is computed: a missing point is listed as
"not run yet".
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from experiments.paper.frontier import method_label
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.errors import TrainingError
from setdiff_mega.tasks import knob_tag

from . import data as D
from . import evaluate as E
from . import plan as P
from . import train as TR
from .points import PointStore, code_fingerprints, point_key


@dataclass
class Context:
    cc: P.ConvertConfig
    store: PointStore
    parent: Path | None = None
    parent_sha: str = ""
    log: object = print
    missing: list = field(default_factory=list)
    models: dict = field(default_factory=dict)        # (arm, task, knob, seed) -> run dir; ("splits", ...) -> data

    def ensure_parent(self) -> Path:
        if self.parent is None:
            self.parent, self.parent_sha = TR.import_parent(self.cc, self.log)
        return self.parent


def store_of(cc: P.ConvertConfig) -> PointStore:
    return PointStore(Path(cc.points), code_fingerprints(), TR.file_sha(cc.config))


def _selected(cc: P.ConvertConfig, arm: P.Arm, seed: int) -> bool:
    return any(a.name == arm.name and seed in a.seeds for a in cc.arms())


def _full_plan(cc: P.ConvertConfig) -> list[P.Arm]:
    full = P.ConvertConfig(**{**cc.__dict__, "only_methods": None, "only_seeds": None})
    return full.arms()


class Child:
    """One (arm, task, knob, seed): its points, computed on demand (training the model first when needed)."""

    def __init__(self, ctx: Context, arm: P.Arm, tp: P.TaskPlan, knob: dict, seed: int, compute: bool):
        self.ctx, self.arm, self.tp, self.knob, self.seed, self.compute = ctx, arm, tp, knob, seed, compute
        self.tag = knob_tag(knob)
        self._loaded = None
        self.rid = ""

    def meta(self) -> dict:
        return {"arm": self.arm.name, "method": method_label(self.arm.method), "kind": P.kind(self.arm.method),
                "recipe": self.arm.recipe.name, "seed": self.seed, "task": self.tp.task, "knob": self.tag}

    def _key(self, kind: str, split: str = "", setting: dict | None = None) -> dict:
        if not self.rid:
            self.rid = TR.run_id(self.ctx.cc, self.arm, self.tp, self.knob, self.ctx.parent_sha)
        return point_key(kind, self.arm.name, self.seed, self.tp.task, self.tag, split, setting, self.rid)

    def on_disk(self) -> Path | None:
        """The trained run directory when it is on this machine (None: not trained here)."""
        d = TR.child_dir(self.ctx.cc, self.arm, self.tp, self.knob, self.seed, self.ctx.parent_sha)
        return d if TR.trained(d, self.tp.steps) else None

    def model(self) -> Path:
        k = (self.arm.name, self.tp.task, self.tag, self.seed)
        if k not in self.ctx.models:
            cc = self.ctx.cc
            parent = self.ctx.ensure_parent()
            d = D.prepare(Path(cc.out_dir), self.tp, self.knob, cc.data_seed, TR.parent_tokenizer(parent), self.ctx.log)
            try:
                rec = TR.train_child(cc, self.arm, self.tp, self.knob, self.seed, d, parent, self.ctx.parent_sha,
                                     self.ctx.log)
            except RuntimeError as e:     # the trainer's process failed: one line (here, since frontier.py is
                                          # under the training fingerprint: editing it would retrain every child)
                if type(e) is not RuntimeError or not str(e).startswith("training "):
                    raise
                raise TrainingError(f"{e}; the same command again resumes it from its newest checkpoint (finished "
                                    f"points are kept)") from None
            if self.ctx.store.get(self._key("train")) is None:     # a run trained before keeps its point and
                self.ctx.store.put(self._key("train"), rec["value"])    # the commit it was trained at
            self.ctx.models[k] = Path(rec["dir"])
        return self.ctx.models[k]

    def loaded(self) -> tuple:
        if self._loaded is None:
            self._loaded = E.load(self.model(), self.ctx.cc.decode_weights)
        return self._loaded

    def point(self, kind: str, split: str, setting: dict | None, compute) -> dict | None:
        key = self._key(kind, split, setting)
        got = self.ctx.store.get(key)
        if got is None and self.compute:
            got = self.ctx.store.put(key, compute())
        if got is None:
            self.ctx.missing.append({**self.meta(), "point": kind, "split": split,
                                     "setting": E.setting_name(setting) if setting else ""})
            return None
        return {**self.meta(), "split": split, "setting": setting or {}, **got}

    def train_point(self) -> dict | None:
        return self.point("train", "", None, lambda: (self.model(), self.ctx.store.get(self._key("train")))[1])

    def accuracy(self, split: str, setting: dict, splits) -> dict | None:
        """``splits``: a function returning the dataset's splits (prepared only when a point is computed)."""
        cc = self.ctx.cc
        return self.point("accuracy", split, setting, lambda: E.accuracy(
            self.loaded(), splits()[split], setting, self.tp.max_new_tokens, cc.eval_batch))

    def nll(self) -> dict | None:
        cc = self.ctx.cc
        return self.point("nll", cc.nll_split, None, lambda: E.nll(self.model(), cc.heldout, cc.nll_limit))


class Parent(Child):
    """The parent itself as an arm (``parent``): no training; its NLL and greedy accuracy."""

    ARM = P.Arm({"objective": P.METHODS[0]["objective"]}, P.Recipe("parent", "the parent, not fine-tuned"), (0,))

    def __init__(self, ctx: Context, tp: P.TaskPlan, knob: dict, compute: bool):
        super().__init__(ctx, self.ARM, tp, knob, 0, compute)

    def meta(self) -> dict:
        return {**super().meta(), "arm": "parent", "method": "parent (AR, not fine-tuned)"}

    def _key(self, kind: str, split: str = "", setting: dict | None = None) -> dict:
        scored = kind == "accuracy"          # the NLL does not depend on the task: one point for every task
        return point_key(kind, "parent", 0, self.tp.task if scored else "", self.tag if scored else "", split,
                         setting, self.ctx.parent_sha)

    def model(self) -> Path:
        return self.ctx.ensure_parent()


def calibrate(ctx: Context, tp: P.TaskPlan, compute: bool) -> dict:
    """The knob (module docstring, step 2): {"rung", "knob", "why", "tried"} or {"knob": None, ...} when a
    needed calibration point is missing and nothing may be computed."""
    cc = ctx.cc
    causal = next(m for m in cc.methods if P.kind(m) == "causal")
    ar = P.Arm(dict(causal), P.BASE, (cc.seeds[0],))
    tried: list = []
    while True:
        step = P.calibration_step(tp, tried, cc.band)
        if "chosen" in step:
            return {**step, "rung": step["chosen"], "knob": tp.ladder[step["chosen"]], "tried": tried}
        knob = tp.ladder[step["next"]]
        child = Child(ctx, ar, tp, knob, cc.seeds[0], compute)
        p = child.accuracy("dev", P.settings(causal, cc.taus_of(tp), cc.rules)[0], _lazy_splits(ctx, tp, knob))
        if p is None:
            return {"knob": None, "why": "calibration not run yet", "tried": tried}
        ctx.log(f"calibration {tp.task} {knob_tag(knob)}: AR dev exact match {p['accuracy']:.3f}")
        tried.append({"rung": step["next"], "knob": knob_tag(knob), "accuracy": p["accuracy"]})


def _lazy_splits(ctx: Context, tp: P.TaskPlan, knob: dict):
    """A function returning the dataset of ``knob``, written on first use (and only then: a study whose points
    are all stored imports no parent and draws no data), with the leak check and the length check run on it."""
    key = ("splits", tp.task, knob_tag(knob))

    def get() -> dict:
        if key not in ctx.models:
            tok_path = TR.parent_tokenizer(ctx.ensure_parent())
            d = D.prepare(Path(ctx.cc.out_dir), tp, knob, ctx.cc.data_seed, tok_path, ctx.log)
            splits = D.load_splits(d)
            splits["lengths"] = D.check_lengths(splits, Tokenizer.from_file(tok_path), tp)
            ctx.models[key] = splits
        return ctx.models[key]
    get.ready = lambda: key in ctx.models
    return get


def run_task(ctx: Context, tp: P.TaskPlan, compute: bool, timings: bool) -> dict:
    """Calibration, every arm's points, roles, test points and timings of one task (module docstring)."""
    cc, t0 = ctx.cc, time.perf_counter()
    cal = calibrate(ctx, tp, compute)
    res = {"task": tp.task, "calibration": cal, "knob": None if cal["knob"] is None else knob_tag(cal["knob"]),
           "train": [], "dev": [], "test": [], "nll": [], "timings": [], "roles": {}}
    if cal["knob"] is None:
        return res
    knob = cal["knob"]
    splits = _lazy_splits(ctx, tp, knob)
    children = [Child(ctx, a, a.task_plan(tp), knob, s, compute and _selected(cc, a, s))
                for a in _full_plan(cc) if a.runs_on(tp.task) for s in a.seeds]
    for ch in children:
        res["train"].append(ch.train_point())
        for s in P.settings(ch.arm.method, cc.taus_of(tp), cc.rules):
            res["dev"].append(ch.accuracy("dev", s, splits))
        res["nll"].append(ch.nll())
    res["dev"] = [p for p in res["dev"] if p]
    chosen = E.roles(res["dev"])
    res["roles"] = {arm: {r: E.setting_name(s) for r, s in v.items()} for (_, arm), v in chosen.items()}
    for ch in children:
        for s in E.chosen_settings(chosen.get((tp.task, ch.arm.name), {})):
            res["test"].append(ch.accuracy("test", s, splits))
    parent = Parent(ctx, tp, knob, compute)
    res["nll"].append(parent.nll())
    res["test"].append(parent.accuracy("test", P.settings(P.METHODS[0], cc.taus_of(tp), cc.rules)[0], splits))
    for k in ("train", "test", "nll"):
        res[k] = [p for p in res[k] if p]
    if splits.ready():
        res["check"], res["lengths"] = splits()["check"], splits()["lengths"]
    if timings:
        res["timings"] = time_arms(ctx, tp, chosen, children, splits)
    res["wall_s"] = time.perf_counter() - t0
    return res


def time_arms(ctx: Context, tp: P.TaskPlan, chosen: dict, children: list[Child], splits) -> list[dict]:
    """Batch-1 timings of each arm's chosen settings on its first seed's model (only models on this machine, or
    trained now when points are being computed)."""
    cc, out = ctx.cc, []
    for arm in (a for a in _full_plan(cc) if a.runs_on(tp.task)):
        ch = next(c for c in children if c.arm.name == arm.name)
        if not ch.compute and ch.on_disk() is None:
            ctx.log(f"  not timed: {tp.task} {arm.name} (its model is not on this machine)")
            continue
        for s in E.chosen_settings(chosen.get((tp.task, arm.name), {})):
            sp = E.speed(ch.loaded(), splits()["test"][:cc.speed_limit], s, tp.max_new_tokens)
            out.append({**ch.meta(), "setting": E.setting_name(s), **sp})
            ctx.log(f"  timed {tp.task} {arm.name} ({E.setting_name(s)}): {sp['tokens_per_s']:.1f} tok/s")
    return out


def run(cc: P.ConvertConfig, compute: bool = True, timings: bool = True, log=print) -> dict:
    """Every task of the plan (selected tasks computed, the others read from the point store)."""
    ctx = Context(cc, store_of(cc), parent_sha=TR.source_sha(cc.parent), log=log)
    selected = {t.task for t in cc.selected()}
    tasks = [run_task(ctx, tp, compute and tp.task in selected, timings and tp.task in selected) for tp in cc.tasks]
    return {"tasks": tasks, "missing": ctx.missing, "parent": cc.parent,
            "parent_sha": ctx.parent_sha, "budget": P.budget(cc)}


def save(results: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    f = out / "convert.json"
    f.write_text(json.dumps(results, indent=1, default=str))
    return f


__all__ = ["run", "run_task", "calibrate", "Child", "Parent", "Context", "store_of", "save", "time_arms"]
