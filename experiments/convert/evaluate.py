"""Scoring the conversion study's children: exact match on chat prompts, the held-out NLL, batch-1 speed, and the
settings each claim uses, chosen on dev.

* :func:`accuracy`: every record of a split asked as the user turn of the checkpoint's chat template
  (``ChatRenderer.of``: the parent's template), decoded greedily in batches of ``batch`` (each row decodes as
  alone), the answer (the text up to its first special token) checked by the task's verifier
  (``Task.verify``: the last integer, after '####' when there is one, equals the reference); the fraction correct
  is the exact match. Tokens per step = delivered tokens (up to and including EOS) per sampler step; commits per
  step counts the commits past EOS too (the reference's ``parallelism_factor``;
  :func:`experiments.planning.evaluate.step_rates`): on 5-digit addition SetDLM commits the EOS and the padding
  after it early while the digits come one per step, 9 or 12 commits for 7 delivered tokens in 6 steps.
* :func:`nll`: NLL per token of the held-out natural text (``setdiff_mega.eval.heldout``, ``kjv``) at
  L = :data:`NLL_L` (the parent's measurement's length) with the method's own estimator (AR exact; BD3LM the
  NELBO; SetDLM the any-order bound of one sampled order: bounds, >= the exact NLL).
* :func:`speed`: one setting at batch 1 on ``n`` records after one untimed warm-up: tokens/s = generated tokens /
  decoding seconds (prefill included) and tokens per forward, in the ``fp32-packed`` weights format. Never cached.
* :func:`roles`: per (task, arm), on the seed means of dev: ``best`` (the highest exact match, ties: more tokens
  per step), ``parity_ar`` (the setting with the most tokens per step within :data:`PARITY` of the AR arm's dev
  exact match) and, for a windowed method, ``parity_bd3lm`` (the most tokens per step within :data:`PARITY` of the
  block method's best). Tokens per step stand in for speed on dev (deterministic; the timings come last).

:func:`.points.code_fingerprints` covers what a point's value depends on, per kind of point, so that a change of the
decoding code re-decodes the trained children and retrains none:

* ``train`` (the weights): :data:`.points.TRAIN_CODE`, the training, model, objective, data, task, checkpoint (the
  parent's import and ``init_from``), config and parallel code, and this package's data / train / points modules and the
  frontier module that writes a child's overrides; the child's run directory is keyed by it too
  (:func:`.train.run_id`), so a change of it trains new children beside the old ones;
* ``accuracy``: the train fingerprint and :data:`.points.DECODE_CODE` (the decoding and inference code, the verifiers,
  this module and the planning study's loader whose options it uses);
* ``nll``: the train fingerprint and :data:`.points.NLL_CODE` (the likelihood estimators and the held-out text).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import setdiff_mega.tasks as T
from experiments.planning import evaluate as PE
from setdiff_mega import methods
from setdiff_mega.checkpoint import load_model
from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.eval import heldout
from setdiff_mega.eval.likelihood import text_nll
from setdiff_mega.inference.api import generate
from setdiff_mega.tasks.score import answer_part

from .plan import kind

PARITY = 0.03
NLL_L = 256


def load(run_dir: Path, decode_weights: str) -> tuple:
    """(decoding model, objective, tokenizer, config) of a run (EMA weights when it kept them)."""
    return PE.load(run_dir, decode_weights)


def _decode(loaded: tuple, records: list[dict], setting: dict, max_new_tokens: int, batch: int) -> list[dict]:
    model, objective, tok, cfg = loaded
    gc = PE.config(loaded, {"max_new_tokens": max_new_tokens, "temperature": 0.0, **setting})
    return generate(model, tok, objective, [r["prompt"] for r in records], gc, context=cfg.data.seq_length,
                    batch_size=batch, chat=ChatRenderer.of(tok))


def accuracy(loaded: tuple, records: list[dict], setting: dict, max_new_tokens: int, batch: int) -> dict:
    """Exact match (the task's verifier) and tokens per step of one setting on ``records``."""
    out = _decode(loaded, records, setting, max_new_tokens, batch)
    correct = [bool(T.get(r["task"]).verify(T.Problem.from_dict(r), answer_part(o["text"])))
               for r, o in zip(records, out)]
    return {"accuracy": sum(correct) / max(len(records), 1), "n": len(records), **PE.step_rates(out),
            "correct": "".join("01"[c] for c in correct)}


def nll(run_dir: Path, name: str = "kjv", limit: int | None = None, batch: int = 8) -> dict:
    """NLL per token of the held-out text ``name`` (its first ``limit`` documents; None: all; module
    docstring)."""
    model, objective, tok, cfg = load_model(run_dir)
    res = text_nll(model, objective, tok, heldout.documents(name)[:limit], NLL_L, 1, 0, batch)
    rec = methods.get(cfg.objective.name)
    return {"nll_per_token": res["nll_per_token"], "tokens": res["tokens"], "estimator": rec.likelihood,
            "heldout": name, "L": NLL_L}


def speed(loaded: tuple, records: list[dict], setting: dict, max_new_tokens: int) -> dict:
    """Batch-1 tokens/s and tokens per forward of one setting (after one untimed warm-up)."""
    _decode(loaded, records[:1], setting, max_new_tokens, 1)
    out = _decode(loaded, records, setting, max_new_tokens, 1)
    secs = sum(o["seconds"] for o in out) or 1e-9
    toks = sum(o["num_tokens"] for o in out)
    return {"tokens_per_s": toks / secs, "tokens_per_forward": toks / max(sum(o["nfe"] for o in out), 1),
            "speed_n": len(out)}


def setting_name(s: dict) -> str:
    parts = [f"W={s['window']}"] if "window" in s else []
    parts.append("greedy" if s["tau"] >= 1e6 and not parts and s.get("commit_rule") == "confidence"
                 else f"tau={s['tau']:g}")
    if "commit_rule" in s and parts[-1] != "greedy":
        parts.append(s["commit_rule"])
    return ", ".join(parts)


def dev_means(points: list[dict]) -> list[dict]:
    """Seed means of dev points per (task, arm, setting): accuracy, tokens per step, seeds."""
    by: dict = {}
    for p in points:
        by.setdefault((p["task"], p["arm"], setting_name(p["setting"])), []).append(p)
    out = []
    for (task, arm, name), ps in sorted(by.items()):
        out.append({"task": task, "arm": arm, "setting_name": name, "setting": ps[0]["setting"],
                    "method": ps[0]["method"], "kind": ps[0]["kind"], "recipe": ps[0]["recipe"], "seeds": len(ps),
                    "accuracy": statistics.fmean(p["accuracy"] for p in ps),
                    "tokens_per_step": statistics.fmean(p["tokens_per_step"] for p in ps)})
    return out


def _fastest(rows: list[dict], floor: float) -> dict | None:
    ok = [r for r in rows if r["accuracy"] >= floor - 1e-12]
    return max(ok, key=lambda r: (r["tokens_per_step"], r["accuracy"])) if ok else None


def roles(dev: list[dict], base: str = "base") -> dict:
    """{(task, arm): {role: setting}} chosen on the dev means (module docstring); the reference AR and block
    arms are those of recipe ``base``."""
    means = dev_means(dev)
    out: dict = {}
    for task in sorted({m["task"] for m in means}):
        rows = [m for m in means if m["task"] == task]
        ref = {k: [m for m in rows if m["kind"] == k and m["recipe"] == base] for k in ("causal", "block")}
        ar = max((m["accuracy"] for m in ref["causal"]), default=None)
        bd = max((m["accuracy"] for m in ref["block"]), default=None)
        for arm in sorted({m["arm"] for m in rows}):
            mine = [m for m in rows if m["arm"] == arm]
            chosen = {"best": max(mine, key=lambda r: (r["accuracy"], r["tokens_per_step"]))}
            if ar is not None and mine[0]["kind"] != "causal":
                chosen["parity_ar"] = _fastest(mine, ar - PARITY)
            if bd is not None and mine[0]["kind"] == "window":
                chosen["parity_bd3lm"] = _fastest(mine, bd - PARITY)
            out[(task, arm)] = {k: v["setting"] for k, v in chosen.items() if v is not None}
    return out


def chosen_settings(chosen: dict) -> list[dict]:
    """The distinct settings of one arm's roles (each decoded once on test)."""
    out: list = []
    for s in chosen.values():
        if s not in out:
            out.append(s)
    return out


__all__ = ["PARITY", "NLL_L", "load", "accuracy", "nll", "speed", "setting_name", "dev_means",
           "roles", "chosen_settings", "kind"]
