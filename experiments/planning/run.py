"""The planning study (issue 56, ``tools/reproduce.py --planning``): where set decoding should beat left to right.

For each task of the plan (:mod:`.plan`): draw every level's splits and the training mixture (:mod:`.data`); train
AR, MDLM, BD3LM and SetDLM from scratch on the same model at equal training FLOPs, three seeds each
(``experiments.paper.frontier.train_model``: a run is reused when its summary shows the planned step count); then

1. **dev**: every decoding policy of every method (:mod:`.policies`) on every level's dev split;
2. **choice**: per task and method, the policy with the best mean dev accuracy over seeds and levels (ties: the
   one that commits more tokens per step);
3. **test**: the chosen policy once on every level's test split (nothing else is decoded on test);
4. **speed**: the chosen policy at batch 1 on the first ``speed_limit`` test problems of each level, in the
   ``fp32-packed`` weights format, after all accuracy work;
5. **order**: on Sudoku, which cells each method's chosen policy fills first (one test puzzle, seed 0).

Everything but the timings is cached (the models under ``<out>/<task>/models``, the accuracies under each
model's ``planning_eval/``), so the study resumes where it stopped; ``only`` limits a run to some tasks and
``seeds`` / ``methods`` to one arm (``tools/reproduce.py --planning --only sudoku4 --seeds 1234 --methods
setdlm_D4``).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from experiments.paper import frontier as F

from . import evaluate as E
from .data import layout, prepare_levels, prepare_mixture, read_records, seq_length
from .plan import PlanningConfig, TaskPlan, equal_flops_steps, level_tag, method_key
from .policies import policies

ORDER_TASKS = ("sudoku4", "sudoku9")


def train_task(pc: PlanningConfig, tp: TaskPlan, corpus: Path, tok, L: int, log=print) -> list[dict]:
    """Every (method, seed) model of ``tp`` at equal FLOPs and length ``L``: [{spec, key, dir, steps, flops,
    seconds, reused}]."""
    budget = equal_flops_steps(pc, tp, tok, L)
    out = []
    for m in pc.methods:
        steps, flops = budget[method_key(m)]
        for seed in pc.seeds:
            spec = {**m, "seed": seed}
            r = F.train_model(spec, steps, Path(pc.out_dir) / tp.task, tp.config,
                              [*pc.overrides, f"data.path={corpus}", f"data.seq_length={L}"], log)
            out.append({**r, "spec": spec, "key": method_key(m), "steps": steps, "flops_per_sample": flops})
    return out


def _points(pc, tp, dirs, models, split: str, chosen: dict | None, log) -> list[dict]:
    """Accuracy points of every model on every level's ``split``: all policies (dev) or the chosen one (test)."""
    out = []
    for mod in models:
        loaded = E.load(mod["dir"], pc.decode_weights)
        for knob in tp.eval_knobs:
            d = dirs[level_tag(knob)]
            records, lay = read_records(d / f"{split}.jsonl"), layout(d)
            for pol in policies(mod["spec"], lay["answer_chars"] + 1):
                if chosen is not None and pol["name"] != chosen[mod["key"]]:
                    continue
                a = E.accuracy(mod["dir"], loaded, records, pol["options"], pc.eval_batch, pc.decode_weights)
                out.append({"task": tp.task, "split": split, "level": knob[tp.curve], "knob": level_tag(knob),
                            "method": F.method_label(mod["spec"]), "key": mod["key"], "seed": mod["spec"]["seed"],
                            "policy": pol["name"], "dir": str(mod["dir"]), **{k: v for k, v in a.items()
                                                                              if k != "correct"}})
                log(f"  {tp.task} {split} {level_tag(knob):<12} {out[-1]['method']:<14} s{out[-1]['seed']:<5} "
                    f"{pol['name']:<32} acc {a['accuracy']:.3f} ({a['tokens_per_step']:.2f} tok/step)")
    return out


def choose(dev: list[dict]) -> dict:
    """{method key: policy name}: the best mean dev accuracy over seeds and levels, then more tokens per step."""
    by: dict = {}
    for p in dev:
        by.setdefault((p["key"], p["policy"]), []).append(p)
    best: dict = {}
    for (key, pol), ps in by.items():
        score = (statistics.fmean(p["accuracy"] for p in ps), statistics.fmean(p["tokens_per_step"] for p in ps))
        if key not in best or score > best[key][0]:
            best[key] = (score, pol)
    return {k: v[1] for k, v in best.items()}


def _speeds(pc, tp, dirs, models, chosen, test: list[dict], log) -> None:
    """Batch-1 timings of the chosen policies, written into the test points (in place)."""
    for mod in models:
        loaded = E.load(mod["dir"], pc.decode_weights)
        for knob in tp.eval_knobs:
            d = dirs[level_tag(knob)]
            records, lay = read_records(d / "test.jsonl")[:pc.speed_limit], layout(d)
            pol = next(p for p in policies(mod["spec"], lay["answer_chars"] + 1) if p["name"] == chosen[mod["key"]])
            s = E.speed(loaded, records, pol["options"])
            for p in test:
                if p["dir"] == str(mod["dir"]) and p["knob"] == level_tag(knob):
                    p.update(s)
        log(f"  timed {tp.task} {F.method_label(mod['spec'])} s{mod['spec']['seed']}")


def _orders(pc, tp, dirs, models, chosen) -> list[dict]:
    if tp.task not in ORDER_TASKS:
        return []
    knob = tp.eval_knobs[len(tp.eval_knobs) // 2]
    d = dirs[level_tag(knob)]
    record, lay = read_records(d / "test.jsonl")[0], layout(d)
    out = []
    for mod in [m for m in models if m["spec"]["seed"] == pc.seeds[0]]:
        pol = next(p for p in policies(mod["spec"], lay["answer_chars"] + 1) if p["name"] == chosen[mod["key"]])
        order = E.fill_order(E.load(mod["dir"], pc.decode_weights), record, pol["options"])
        out.append({"task": tp.task, "knob": level_tag(knob), "method": F.method_label(mod["spec"]),
                    "policy": pol["name"], "prompt": record["prompt"], "order": order})
    return out


def run_task(pc: PlanningConfig, tp: TaskPlan, log=print) -> dict:
    """Data, models, dev points, the choice, test points, timings and fill orders of one task."""
    from setdiff_mega.data.tokenizer import Tokenizer

    t0 = time.perf_counter()
    dirs = prepare_levels(Path(pc.out_dir), tp, pc.data_seed, log)
    corpus = prepare_mixture(Path(pc.out_dir), tp, dirs, log)
    tok = Tokenizer.from_file(corpus.parent / "tokenizer.json")
    models = train_task(pc, tp, corpus, tok, seq_length(tp, dirs), log)
    t_train = time.perf_counter() - t0
    dev = _points(pc, tp, dirs, models, "dev", None, log)
    chosen = choose(dev)
    test = _points(pc, tp, dirs, models, "test", chosen, log)
    t_eval = time.perf_counter() - t0 - t_train
    _speeds(pc, tp, dirs, models, chosen, test, log)
    orders = _orders(pc, tp, dirs, models, chosen)
    training = [{"task": tp.task, "method": F.method_label(m["spec"]), "key": m["key"], "seed": m["spec"]["seed"],
                 "steps": m["steps"], "flops_per_sample": m["flops_per_sample"], "seconds": round(m["seconds"], 1),
                 "reused": m["reused"], **_summary(m["dir"])} for m in models]
    return {"task": tp.task, "curve": tp.curve, "dev": dev, "test": test, "chosen": chosen, "orders": orders,
            "training": training, "levels": {k: json.loads((d / "task.json").read_text())["report"]
                                             for k, d in dirs.items()},
            "wall_s": {"train": t_train, "eval": t_eval, "all": time.perf_counter() - t0}}


def _summary(run_dir) -> dict:
    s = json.loads((Path(run_dir) / "summary.json").read_text())
    return {"parameters": s.get("num_parameters"), "final_val_loss": s.get("final_val_loss"),
            "final_step": s.get("final_step")}


def run(pc: PlanningConfig, log=print) -> list[dict]:
    """Every selected task, one after the other (each resumable)."""
    return [run_task(pc, tp, log) for tp in pc.selected()]


__all__ = ["run", "run_task", "train_task", "choose", "ORDER_TASKS"]
