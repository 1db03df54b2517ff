"""The conversion study's data: one chat-layout dataset per (task, knob), held out by computation and checked.

Layout under ``<out>/data/<task>/<knob tag>/`` (:func:`setdiff_mega.data.prepare.prepare_task`, the code of
``tools/prepare_data.py --task T --format chat --tokenizer TOK``)::

    train.jsonl / dev.jsonl / test.jsonl   supervised records: prompt = the user turn, response = the assistant's
                                           answer (arithmetic: the worked solution ending '#### n'; addition:
                                           the number only), with the problem's fields for the verifier
    tokenizer.json                         the parent's tokenizer with its chat template
    corpus.*                               the train split rendered with that template (data.format=sft)
    task.json                              the spec, the split report and the leak check

A directory is reused while its ``task.json`` records the same spec. :func:`load_splits` re-runs the leak check
(``setdiff_mega.tasks.check_heldout``: no dev / test computation, group or answer string in any training record)
every time a dataset is read, and :func:`check_lengths` refuses, with one line, a dataset whose conversations do
not fit L or whose reference answers do not fit the decoding budget (the answer + EOS within ``max_new_tokens``,
the prompt + that budget within L).
"""
from __future__ import annotations

import json
from pathlib import Path

from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.data.prepare import prepare_task, task_is_current, task_spec
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.tasks import check_heldout, knob_tag

from .plan import TaskPlan


def task_dir(out: Path, tp: TaskPlan, knob: dict) -> Path:
    return Path(out) / "data" / tp.task / knob_tag(knob)


def spec_of(tp: TaskPlan, knob: dict, seed: int, tokenizer: Path) -> dict:
    return task_spec(tp.task, knob, "chat", seed, {"train": tp.num_train, "dev": tp.num_dev, "test": tp.num_test},
                     str(tokenizer))


def prepare(out: Path, tp: TaskPlan, knob: dict, seed: int, tokenizer: Path, log=print) -> Path:
    """The dataset of ``tp`` at ``knob`` (written, or reused while current); returns its directory."""
    d = task_dir(out, tp, knob)
    spec = spec_of(tp, knob, seed, tokenizer)
    if not task_is_current(d, spec):
        log(f"drawing {tp.task} {knob_tag(knob)} ({tp.num_train} train, {tp.num_dev} dev, {tp.num_test} test, chat "
            f"layout)")
        d.mkdir(parents=True, exist_ok=True)
        prepare_task(d, spec, workers=1, log=log)
    return d


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def load_splits(d: Path) -> dict:
    """{split: records} of a dataset directory, the leak check run again (module docstring); ``"check"``: its
    counts."""
    splits = {s: read_records(Path(d) / f"{s}.jsonl") for s in ("train", "dev", "test")}
    return {**splits, "check": check_heldout(splits)}


def check_lengths(splits: dict, tok: Tokenizer, tp: TaskPlan) -> dict:
    """The longest conversation and answer in tokens; ValueError naming the field to change when one does not fit."""
    chat = ChatRenderer.of(tok)
    longest_doc = longest_answer = longest_prompt = 0
    for split in ("train", "dev", "test"):
        for r in splits[split]:
            p = len(chat.prompt_ids(r["prompt"]))
            a = len(tok.encode(r["response"])) + 1
            longest_prompt, longest_answer = max(longest_prompt, p), max(longest_answer, a)
            longest_doc = max(longest_doc, p + a)
    if longest_doc > tp.seq_length:
        raise ValueError(f"{tp.task}: a conversation has {longest_doc} tokens > seq_length={tp.seq_length}: raise the "
                         f"task plan's seq_length")
    if longest_answer > tp.max_new_tokens or longest_prompt + tp.max_new_tokens > tp.seq_length:
        raise ValueError(f"{tp.task}: an answer needs {longest_answer} tokens (max_new_tokens={tp.max_new_tokens}) "
                         f"after a prompt of up to {longest_prompt} (seq_length={tp.seq_length}): raise "
                         f"max_new_tokens or seq_length in the task plan")
    return {"longest_document": longest_doc, "longest_answer": longest_answer, "longest_prompt": longest_prompt}


__all__ = ["task_dir", "spec_of", "prepare", "read_records", "load_splits", "check_lengths"]
