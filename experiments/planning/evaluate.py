"""Scoring a planning model: accuracy of a decoding policy on a split, its speed at batch 1, and the order in
which it fills the answer.

* :func:`accuracy`: every record of a split decoded greedily in batches (each row decodes as alone), the answer
  (the text up to its first special token) checked by the task's verifier (``setdiff_mega.tasks.score``:
  validity, not string equality: any valid Sudoku grid or Countdown expression counts) and by exact match;
  tokens per step (:func:`step_rates`) = the tokens a row delivers (its generated tokens up to and including
  EOS) per sampler step, and commits per step = every commit per step, also those past EOS that the output drops
  (the reference's ``parallelism_factor``; a window or block that commits padding after a confident EOS inflates
  it: 9 commits for a 7-token answer in 6 steps). Cached under the model's directory, keyed by the checkpoint's
  ``state.json``, the options, the records' SHA-256, the batch, the weights format and the code
  (:func:`experiments.provenance.fingerprint` of the decoding code, the tasks package and this module); each
  cached point records the commit and fingerprint it was computed at.
* :func:`speed`: the same policy at batch 1 on the first ``n`` records, timed (tokens/s = generated tokens /
  decoding seconds, prefill included), in the ``fp32-packed`` weights format unless told otherwise.
* :func:`fill_order`: one record decoded with ``record=True``: the sampler step at which each answer position was
  committed (0 = first), the picture of which cells a method fills first.

Requests are the grid layout's prompt, ``[BOS] prompt [SEP]``, as token ids; ``max_new_tokens`` is the level's
answer length + EOS (:mod:`.policies`).
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import setdiff_mega.tasks as T
from experiments.provenance import DECODING_CODE, fingerprint, git_commit
from setdiff_mega.checkpoint import load_model
from setdiff_mega.checkpoint.io import latest_checkpoint
from setdiff_mega.decoding.config import GenerationConfig
from setdiff_mega.inference.api import generate
from setdiff_mega.inference.engine import decoding_model
from setdiff_mega.inference.options import generation_config
from setdiff_mega.outputs import write_file_atomic
from setdiff_mega.tasks.score import answer_part

EVAL_VERSION = 2                 # 2: tokens per step counts delivered tokens (step_rates)


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    return fingerprint((*DECODING_CODE, "tasks"), extra=(Path(__file__),))


def load(run_dir: Path, decode_weights: str = "auto") -> tuple:
    """(decoding model, objective, tokenizer, config) of a trained run (EMA weights when it kept them)."""
    model, objective, tok, cfg = load_model(run_dir)
    return decoding_model(model, cfg, tok, "auto", decode_weights), objective, tok, cfg


def config(loaded: tuple, options: dict) -> GenerationConfig:
    _, _, _, cfg = loaded
    return generation_config(cfg.objective, cfg.data.seq_length, None, options)


def requests(tok, records: list[dict]) -> list[dict]:
    return [{"input_ids": [tok.bos] + tok.encode(r["prompt"])} for r in records]


def records_hash(records: list[dict]) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r["prompt"], r["response"], r["key"]]).encode() + b"\n")
    return h.hexdigest()[:16]


def _key(run_dir: Path, gc: GenerationConfig, rows: str, batch: int, weights: str) -> str:
    ck = latest_checkpoint(run_dir)
    if ck is None:
        raise FileNotFoundError(f"'{run_dir}' holds no checkpoint to evaluate")
    h = hashlib.sha256((Path(ck) / "state.json").read_bytes())
    h.update(json.dumps([repr(gc), rows, batch, weights, EVAL_VERSION, code_fingerprint()]).encode())
    return h.hexdigest()[:20]


def _decode(loaded: tuple, records: list[dict], gc: GenerationConfig, batch: int) -> list[dict]:
    model, objective, tok, cfg = loaded
    return generate(model, tok, objective, requests(tok, records), gc, context=cfg.data.seq_length,
                    batch_size=batch)


def step_rates(out: list[dict]) -> dict:
    """Tokens per sampler step of decoded rows (module docstring): delivered and every commit."""
    steps = sum(o["steps"] for o in out) or 1
    return {"tokens_per_step": sum(o["num_tokens"] for o in out) / steps,
            "commits_per_step": sum(o["committed"] for o in out) / steps}


def accuracy(run_dir: Path, loaded: tuple, records: list[dict], options: dict, batch: int, weights: str) -> dict:
    """Verifier accuracy, exact match and tokens per step of one policy on ``records`` (cached; module docstring)."""
    gc = config(loaded, options)
    f = Path(run_dir) / "planning_eval" / f"{_key(run_dir, gc, records_hash(records), batch, weights)}.json"
    if f.is_file():
        return json.loads(f.read_text())
    out = _decode(loaded, records, gc, batch)
    answers = [answer_part(o["text"]) for o in out]
    correct = [bool(T.get(r["task"]).verify(T.Problem.from_dict(r), a)) for r, a in zip(records, answers)]
    n = max(len(records), 1)
    res = {"accuracy": sum(correct) / n, "n": len(records), "correct": correct,
           "exact_match": sum(a.strip() == r["response"].strip() for r, a in zip(records, answers)) / n,
           **step_rates(out), "computed_at": {"commit": git_commit(), "code": code_fingerprint()}}
    write_file_atomic(f, json.dumps(res))
    return res


def speed(loaded: tuple, records: list[dict], options: dict) -> dict:
    """Batch-1 tokens/s and tokens per forward of one policy on ``records`` (after one untimed warm-up)."""
    gc = config(loaded, options)
    _decode(loaded, records[:1], gc, 1)
    out = _decode(loaded, records, gc, 1)
    secs = sum(o["seconds"] for o in out) or 1e-9
    toks = sum(o["num_tokens"] for o in out)
    return {"tokens_per_s": toks / secs, "tokens_per_forward": toks / max(sum(o["nfe"] for o in out), 1),
            "speed_n": len(out)}


def fill_order(loaded: tuple, record: dict, options: dict) -> list[int]:
    """The step (0-based, in commit order) at which each answer position was committed (module docstring)."""
    gc = config(loaded, {**options, "record": True})
    o = _decode(loaded, [record], gc, 1)[0]
    steps = o.get("commit_steps") or []
    first = min(steps) if steps else 0
    return [int(s) - first for s in steps]


__all__ = ["step_rates", "load", "accuracy", "speed", "fill_order", "records_hash", "requests", "EVAL_VERSION"]
