"""The planning study's data: every level's splits, and one training set per task mixing its training levels.

Layout under ``<out>/data/<task>/``::

    <level tag>/        one prepare_task directory per knob level (train / dev / test.jsonl, tokenizer.json,
                        corpus.* = that level's train split as supervised data, task.json with the split report
                        and the leak check); reused while task.json records the same spec
    mix/corpus.*        the train splits of the training levels preprocessed together (data.format=sft),
                        tokenizer.json beside it and mix.json naming its inputs and their SHA-256s (reused while
                        they match)

Every level is drawn with the character vocabulary of ``setdiff_mega.tasks`` (the same ids at every level), so
one tokenizer reads all of them. The leak check of each level runs when it is written; :func:`check_mixture`
runs it again across levels: no dev or test problem of any level has its computation or answer in the mixture.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from setdiff_mega.data.prepare import prepare_task, task_is_current, task_spec
from setdiff_mega.data.sft import preprocess_sft
from setdiff_mega.tasks import check_heldout

from .plan import TaskPlan, level_tag


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def level_dir(out: Path, tp: TaskPlan, knob: dict) -> Path:
    return Path(out) / "data" / tp.task / level_tag(knob)


def prepare_levels(out: Path, tp: TaskPlan, seed: int, log=print) -> dict:
    """{level tag: directory} of every level of ``tp`` (written, or reused while current)."""
    dirs = {}
    for knob in tp.levels():
        # a level only scored still gets a token train split: prepare_task writes every level as a dataset
        train = tp.num_train if knob in tp.train_knobs else 16
        spec = task_spec(tp.task, knob, "grid", seed, {"train": train, "dev": tp.num_dev, "test": tp.num_test},
                         None)
        d = level_dir(out, tp, knob)
        if not task_is_current(d, spec):
            log(f"drawing {tp.task} {level_tag(knob)} ({train} train, {tp.num_dev} dev, {tp.num_test} test)")
            d.mkdir(parents=True, exist_ok=True)
            prepare_task(d, spec, log=log)
        dirs[level_tag(knob)] = d
    return dirs


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def check_mixture(tp: TaskPlan, dirs: dict) -> dict:
    """The leak check across levels: the mixture's training records against every level's dev and test."""
    train = [r for k in tp.train_knobs for r in read_records(dirs[level_tag(k)] / "train.jsonl")]
    held = {s: [r for k in tp.eval_knobs for r in read_records(dirs[level_tag(k)] / f"{s}.jsonl")]
            for s in ("dev", "test")}
    return check_heldout({"train": train, **held})


def prepare_mixture(out: Path, tp: TaskPlan, dirs: dict, log=print) -> Path:
    """The task's training set (``mix/corpus``), rebuilt when its inputs changed; returns its prefix."""
    mix = Path(out) / "data" / tp.task / "mix"
    inputs = [dirs[level_tag(k)] / "train.jsonl" for k in tp.train_knobs]
    tok = dirs[level_tag(tp.train_knobs[0])] / "tokenizer.json"
    record = {"inputs": [str(p) for p in inputs], "sha256": [_sha(p) for p in inputs], "tokenizer": _sha(tok)}
    meta = mix / "mix.json"
    if meta.is_file() and json.loads(meta.read_text()).get("record") == record:
        return mix / "corpus"
    check = check_mixture(tp, dirs)
    mix.mkdir(parents=True, exist_ok=True)
    (mix / "tokenizer.json").write_bytes(tok.read_bytes())
    log(f"mixing {tp.task}'s training levels: {', '.join(level_tag(k) for k in tp.train_knobs)}")
    preprocess_sft([str(p) for p in inputs], str(mix / "corpus"), str(mix / "tokenizer.json"), chat_template="none",
                   workers=1, progress=False, overwrite=True, log=log)
    meta.write_text(json.dumps({"record": record, "check": check}, indent=1))
    return mix / "corpus"


def layout(level: Path) -> dict:
    """A level's grid layout (task.json): prompt and answer characters, where the answer starts."""
    lay = json.loads((Path(level) / "task.json").read_text()).get("layout")
    if not lay:
        raise ValueError(f"'{level}' has no fixed grid layout (task.json): the planning study decodes fixed-length "
                         f"answers")
    return lay


def seq_length(tp: TaskPlan, dirs: dict, multiple: int = 4) -> int:
    """The training length L that holds every level's document (train and scored levels alike: the longest
    prompt must fit L when decoded), rounded up to a multiple of ``multiple`` (BD3LM's block)."""
    longest = max(layout(dirs[level_tag(k)])["document_tokens"] for k in tp.levels())
    return -(-longest // multiple) * multiple


__all__ = ["seq_length", "level_dir", "prepare_levels", "prepare_mixture", "check_mixture", "read_records", "layout"]
