"""Scoring generations of task problems with their verifiers.

A generation record is what ``tools/generate.py --file <split>.jsonl --out gen.jsonl`` writes: the request (the
task record itself, :meth:`~.base.Task.record`) and the generated ``text``. The answer is the text up to the first
special token (``<|``: the project's ``<|eos|>``, a chat model's ``<|im_end|>``); the verifier decides (validity,
not string equality). Exact match is reported beside it: the answer equal to the reference response.
"""
from __future__ import annotations

from .base import Problem, TaskError
from .registry import get


def answer_part(text: str) -> str:
    """The generated text up to its first special token."""
    return text.split("<|", 1)[0]


def score(pairs) -> dict:
    """``pairs``: (task record, generated text) -> {n, correct, accuracy, exact, by_task}."""
    n = correct = exact = 0
    by_task: dict = {}
    for record, text in pairs:
        if not isinstance(record, dict) or "task" not in record:
            raise TaskError("a generation's request is not a task record: generate from a split file written by "
                            "tools/prepare_data.py --task (its requests carry the problem)")
        task, ans = get(record["task"]), answer_part(text)
        ok = task.verify(Problem.from_dict(record), ans)
        n, correct, exact = n + 1, correct + ok, exact + (ans.strip() == record["response"].strip())
        t = by_task.setdefault(record["task"], {"n": 0, "correct": 0})
        t["n"], t["correct"] = t["n"] + 1, t["correct"] + ok
    for t in by_task.values():
        t["accuracy"] = t["correct"] / t["n"]
    return {"n": n, "correct": correct, "accuracy": correct / n if n else 0.0, "exact_match": exact / n if n else 0.0,
            "by_task": by_task}


__all__ = ["score", "answer_part"]
