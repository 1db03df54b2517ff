"""The adaptation recipe's data (:mod:`.recipe`): supervised conversations and held-out problems split **by
computation**, with a difficulty knob (issue 55; the earlier study held problems out by question string, and 511 of
its 512 worked solutions were in its training data).

**Problems**: :mod:`setdiff_mega.tasks.arithmetic` at the study's knob (default ``steps=2, max_value=50``: two
equations of a worked solution, numbers up to 50, about 10^6 distinct computations). A problem's split is a hash of
its computation (the equations with the operands of + and x sorted; :mod:`setdiff_mega.tasks.splits`), so no dev or
test computation is ever drawn for training, at any seed.

**The pretraining corpus**: the embedded corpus holds arithmetic and GSM8K-like documents with worked solutions of
its own (:mod:`setdiff_mega.data.corpus`). :func:`corpus_keys` parses their equations (``a op b = c``) into the same
canonical computations; a dev / test problem whose computation occurs there is dropped (counted, and the report
says how many), and more are drawn until the split is full. Other corpora are not searched (the report says so).

**Splits**: the conversations come from the train split; dev (:data:`DEV`, default 256 problems) chooses the
sampler settings; test (``limit``, default 512) is decoded once with the chosen settings. :func:`check` runs the
task package's leak check (keys and groups disjoint, no held-out solution in any training record) on every set the
recipe writes.

Rows (the evaluation's fields): ``question`` (the story), ``answer``, ``solution`` (one equation per line) and
``key`` (the computation).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from setdiff_mega.data.corpus import embedded_corpus, write_jsonl
from setdiff_mega.eval.tasks import GSM8K_INSTRUCTION
from setdiff_mega.tasks.splits import check_heldout, draw

TASK = "arithmetic"
KNOB = {"steps": 2, "max_value": 50}
DEV = 256
EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def canonical_of(text: str) -> str:
    """The canonical computation of the equations in ``text`` (:func:`setdiff_mega.tasks.arithmetic.canonical`)."""
    from setdiff_mega.tasks.arithmetic import canonical

    return canonical([(int(a), op, int(b)) for a, op, b, _ in EQUATION.findall(text)])


def corpus_keys(corpus_prefix: str | Path) -> set[str] | None:
    """The computations of the embedded pretraining corpus's worked solutions at ``corpus_prefix`` (every document
    with a solution, arithmetic and GSM8K-like alike); None: not the embedded corpus (no ``embedded.json``)."""
    meta = Path(corpus_prefix).parent / "embedded.json"
    if not meta.is_file():
        return None
    m = json.loads(meta.read_text())
    docs = embedded_corpus(m["num_math"], m["num_stories"], m["seed"], m.get("num_arith"), m.get("num_quests"))
    return {canonical_of(d["solution"]) for d in docs if d.get("solution")}


def _row(p) -> dict:
    solution = p.extra["solution"].rsplit("\n####", 1)[0]
    return {"question": p.question["text"], "answer": p.answer, "solution": solution, "key": p.key,
            "problem": p.to_dict()}


def heldout(split: str, n: int, knob: dict, seed: int, exclude: set[str] | None) -> tuple[list[dict], int]:
    """(``n`` rows of ``split`` whose computation is not in ``exclude``, how many were dropped for it on the way).
    The draw is deterministic in (knob, seed, split) and a longer draw extends a shorter one, so the rows do not
    depend on how many the corpus check drops."""
    ask = n
    while True:
        probs, exhausted = draw(TASK, knob, split, ask, seed)
        kept, dropped = [], 0
        for p in probs:
            if exclude and p.key in exclude:
                dropped += 1
            elif len(kept) < n:
                kept.append(p)
            if len(kept) == n:
                return [_row(p) for p in kept], dropped
        if exhausted:
            raise ValueError(f"{TASK} {knob}: only {len(kept)} {split} problems outside the training data "
                             f"(asked {n}): choose a larger max_value or more steps")
        ask *= 2


def conversations(n: int, knob: dict, seed: int) -> list[dict]:
    """``n`` chat records of the train split (the GSM8K instruction, the story; the worked solution and the boxed
    answer, the format the evaluation scores)."""
    probs, _ = draw(TASK, knob, "train", n, seed)
    return [{"messages": [
        {"role": "user", "content": GSM8K_INSTRUCTION + r["question"]},
        {"role": "assistant", "content": f"{r['solution']}\nThe answer is $\\boxed{{{r['answer']}}}$."}],
        "key": r["key"]} for r in map(_row, probs)]


def check(chats: list[dict], dev: list[dict], test: list[dict]) -> dict:
    """The task package's leak check (:func:`setdiff_mega.tasks.splits.check_heldout`) over the conversations as
    training records and the held-out rows, each held-out row's worked solution (its equations) being the string
    that must occur in no training text."""
    def rec(r: dict) -> dict:
        return {**r["problem"], "prompt": GSM8K_INSTRUCTION + r["question"], "response": r["solution"]}

    train = [{"key": c["key"], "group": c["key"], "prompt": c["messages"][0]["content"],
              "response": c["messages"][1]["content"]} for c in chats]
    return check_heldout({"train": train, "dev": [rec(r) for r in dev], "test": [rec(r) for r in test]})


def problems_hash(rows: list[dict]) -> str:
    """sha256 (16 hex) of the questions and answers (an evaluation cache key)."""
    h = hashlib.sha256()
    for r in rows:
        h.update(f"{r['question']}\t{r['answer']}\n".encode())
    return h.hexdigest()[:16]


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


__all__ = ["TASK", "KNOB", "DEV", "canonical_of", "corpus_keys", "heldout", "conversations", "check",
           "problems_hash", "read_jsonl", "write_jsonl", "GSM8K_INSTRUCTION"]
