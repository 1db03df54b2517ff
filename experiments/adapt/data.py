"""The adaptation recipe's data beside its supervised conversations (:mod:`.adapt`): the held-out evaluation
problems (the self-distilled supervised set is :mod:`setdiff_mega.inference.distill`'s).

**Held-out problems** (:func:`eval_problems`): an evaluation that resolves a few points needs hundreds of
problems (one problem of 512 is 0.002; the binomial standard error at 85% exact match is 0.016). The arithmetic
task file holds 128 (held out of the pretraining corpus by ``tools/prepare_data.py``); the recipe takes them first,
then new problems from a stream of their own (``seed + 303``), skipping every question of the supervised
conversations, of the pretraining corpus (regenerated from the corpus directory's ``embedded.json`` when the corpus
is the embedded one; other corpora are not searched, and the report says so) and every repeat, until ``n``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from setdiff_mega.data.corpus import arith_problems, embedded_corpus, write_jsonl
from setdiff_mega.eval.tasks import GSM8K_INSTRUCTION


def corpus_questions(corpus_prefix: str | Path) -> set[str] | None:
    """The arithmetic questions of the embedded pretraining corpus at ``corpus_prefix`` (None: not the embedded
    corpus, or no ``embedded.json`` next to it)."""
    meta = Path(corpus_prefix).parent / "embedded.json"
    if not meta.is_file():
        return None
    m = json.loads(meta.read_text())
    docs = embedded_corpus(m["num_math"], m["num_stories"], m["seed"], m.get("num_arith"), m.get("num_quests"))
    return {d["question"] for d in docs if d["task"] == "arith"}


def eval_problems(n: int, seed: int, task_rows: list[dict], exclude: set[str]) -> list[dict]:
    """``n`` held-out arithmetic problems: ``task_rows`` first, then fresh ones (module docstring), none with a
    question in ``exclude``, none repeated."""
    out, seen = [], set(exclude)
    for r in task_rows:
        if len(out) < n and r["question"] not in seen:
            out.append(r)
            seen.add(r["question"])
    stream, chunk = 0, max(4 * (n - len(out)), 64)
    while len(out) < n:
        for p in arith_problems(chunk, seed + 303 + 7919 * stream):
            if len(out) < n and p["question"] not in seen:
                out.append(p)
                seen.add(p["question"])
        stream += 1
        if stream > 1000:
            raise ValueError(f"could not draw {n} distinct held-out arithmetic problems outside the training data")
    return out


def problems_hash(rows: list[dict]) -> str:
    """sha256 (16 hex) of the questions and answers (an evaluation cache key)."""
    h = hashlib.sha256()
    for r in rows:
        h.update(f"{r['question']}\t{r['answer']}\n".encode())
    return h.hexdigest()[:16]


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


__all__ = ["corpus_questions", "eval_problems", "problems_hash", "read_jsonl", "write_jsonl", "GSM8K_INSTRUCTION"]
