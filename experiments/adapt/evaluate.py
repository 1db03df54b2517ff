"""Evaluation of the adaptation recipe (:mod:`.recipe`): exact match on many held-out problems in batches, and the
decoding speed at batch 1, measured apart.

* :func:`settings`: a model's sampler settings: AR one token per step; BD3LM tau x commit rule; SetDLM W x tau x
  commit rule (``commit_rule``: the paper's "confidence" or the AR-anchored "leftmost", :mod:`~setdiff_mega.
  decoding.sampling`).
* :func:`accuracy_point`: exact match, step accuracy, tokens per step (commits per step) and forwards on every
  held-out problem, decoded in batches of ``batch_size`` (each row decodes exactly as alone: the samplers keep every
  row's state to itself, ``tests/inference/test_serving_batching.py``), chat prompts, greedy, EMA weights. Cached
  under the model's run directory, keyed by the checkpoint's ``state.json`` (its files' SHA-256s), the setting, the
  problems, the batch size, the engine and :data:`EVAL_VERSION`.
* :func:`speed_point`: the same setting at batch 1 on the first ``n`` problems, timed (tokens/s = generated tokens
  / decoding seconds, prefill included; forwards; ms per forward; rows per forward: the chunk's width, prefills
  included), and the agreement of its answers with the
  batched run's on those problems: 1.0 means the batched accuracies are batch 1's (a code change since the cached
  accuracy would show here). The recipe runs every timing after all training and accuracy work, so nothing else
  of the recipe shares the machine with it.
* :func:`resolution`: what the design can resolve: the binomial standard error of one seed's exact match on n
  problems, and the 95% interval half-width of a difference of two k-seed means (Welch, from the seeds' standard
  deviations).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from pathlib import Path

from experiments.provenance import DECODING_CODE, fingerprint, git_commit
from setdiff_mega import methods
from setdiff_mega.checkpoint.io import latest_checkpoint
from setdiff_mega.eval.tasks import math_accuracy
from setdiff_mega.inference.benchmark import TimedModel
from setdiff_mega.inference.options import generation_config
from setdiff_mega.outputs import write_file_atomic

EVAL_VERSION = 1        # bump when scoring changes: cached accuracies are recomputed
RULES = ("confidence", "leftmost")


def settings(spec: dict, taus: list, rules=RULES, windows: tuple = (1, 2)) -> list[dict]:
    """The sampler settings of a model (module docstring); ``windows``: SetDLM's W as multiples of D."""
    rec = methods.get(spec["objective"])
    if rec.causal:
        return [{"tau": 1e6, "commit_rule": "confidence"}]
    out = [{"tau": t, "commit_rule": r} for r in rules for t in taus]
    if rec.window:
        return [{"window": int(w * spec["D"]), **s} for w in windows for s in out]
    return out


def _gc(cfg, setting: dict, max_new_tokens: int):
    return generation_config(cfg.objective, cfg.data.seq_length, None, {"max_new_tokens": max_new_tokens,
                                                                        **setting})


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """The decoding code's fingerprint and this module's (the scoring): :func:`experiments.provenance.fingerprint`."""
    return fingerprint(DECODING_CODE, extra=(Path(__file__),))


def cache_key(run_dir: Path, gc, problems: str, batch_size: int, engine: str) -> str:
    """sha256 of what an accuracy depends on (module docstring): the checkpoint, the setting, the problems' hash,
    the batch size, the engine, the scoring version and the code."""
    ck = latest_checkpoint(run_dir)
    if ck is None:
        raise FileNotFoundError(f"'{run_dir}' holds no checkpoint to evaluate")
    h = hashlib.sha256((Path(ck) / "state.json").read_bytes())
    h.update(json.dumps([dataclasses.asdict(gc), problems, batch_size, engine, EVAL_VERSION, code_fingerprint()],
                        sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


def accuracy_point(run_dir: Path, loaded: tuple, rows: list[dict], setting: dict, chat, problems: str,
                   batch_size: int, engine: str, max_new_tokens: int) -> dict:
    """Exact match of one setting on ``rows`` in batches (cached; module docstring)."""
    model, objective, tok, cfg = loaded
    gc = _gc(cfg, setting, max_new_tokens)
    f = Path(run_dir) / "eval_cache" / f"{cache_key(run_dir, gc, problems, batch_size, engine)}.json"
    if f.is_file():
        return json.loads(f.read_text())
    r = math_accuracy(model, tok, objective, rows, gc, cfg.data.seq_length, batch_size, chat=chat, keep_texts=True)
    out = {"accuracy": r["accuracy"], "step_accuracy": r["step_accuracy"], "copy_accuracy": r["copy_accuracy"],
           "tokens_per_step": r["tokens_per_step"], "n": r["n"], "skipped": r["skipped_too_long"],
           "texts": r["texts"], "correct": r["correct"],
           "computed_at": {"commit": git_commit(), "code": code_fingerprint()}}
    write_file_atomic(f, json.dumps(out))
    return out


def speed_point(loaded: tuple, rows: list[dict], setting: dict, chat, batched_texts: list[str],
                max_new_tokens: int) -> dict:
    """Batch-1 speed of one setting on ``rows`` and the agreement with the batched answers (module docstring)."""
    model, objective, tok, cfg = loaded
    timed = TimedModel(model)
    r = math_accuracy(timed, tok, objective, rows, _gc(cfg, setting, max_new_tokens), cfg.data.seq_length, 1,
                      chat=chat, keep_texts=True)
    same = sum(a == b for a, b in zip(r["texts"], batched_texts))
    return {"tokens_per_s": r["tokens_per_s"], "forwards": r["forwards"], "ms_per_forward": r["ms_per_forward"],
            "rows_per_forward": sum(timed.widths) / max(len(timed.widths), 1),
            "speed_tokens_per_step": r["tokens_per_step"], "speed_n": r["n"],
            "agreement": same / max(len(r["texts"]), 1)}


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (normal beyond 30)."""
    from scipy.stats import t

    return float(t.ppf(0.975, df)) if 0 < df <= 30 else 1.96


def resolution(n: int, seeds: int, accuracy: float, seed_sd: float | None) -> dict:
    """(binomial standard error of one seed at ``accuracy`` on ``n`` problems, 95% half-width of the difference of
    two ``seeds``-seed means whose per-seed sd is ``seed_sd``, t with 2 (seeds - 1) degrees of freedom)."""
    se = math.sqrt(max(accuracy * (1 - accuracy), 1e-12) / max(n, 1))
    sd = seed_sd if seed_sd is not None else se
    return {"binomial_se": se, "difference_95": t95(2 * (seeds - 1)) * math.sqrt(2 * sd * sd / max(seeds, 1))}


__all__ = ["EVAL_VERSION", "RULES", "settings", "code_fingerprint", "cache_key",
           "accuracy_point", "speed_point", "resolution", "t95"]
