"""Corpus -> tokenizer -> indexed dataset, the preparation step behind ``tools/prepare_data.py``.

Output directory layout (``out``):
    tokenizer.json                     byte-level BPE with <|bos|> <|eos|> <|pad|> <|mask|>
    corpus.bin / corpus.idx            one document per text: [BOS] tokens [EOS]
    corpus.manifest.json               counts, dtype, tokenizer hash + special ids, SHA-256s
    tasks/{math,stories,arith,quests}.jsonl (embedded corpus only) held-out task documents, ``heldout``
                                       per task; no training document has the text of one of them
    embedded.json                      (embedded corpus only) the generator's version and counts: a
                                       ``--skip-existing`` run reuses the output only when they match

A generated task (:func:`prepare_task`, ``--task``; ``setdiff_mega/tasks``) writes instead
    {train,dev,test}.jsonl             the splits' supervised records (prompt = context, response = target, the
                                       problem's fields for scoring), held out by computation and checked
    tokenizer.json                     the character vocabulary (grid layout) or the given tokenizer (chat layout)
    corpus.{bin,idx} + corpus.target.{bin,idx} + manifest   the train split as supervised data (data.format=sft)
    task.json                          task, knob, layout, seed, sizes, the split report and the leak check
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from setdiff_mega import tasks

from .corpus import CORPUS_VERSION, corpus_counts, embedded_corpus, read_documents, split_heldout, write_jsonl
from .fast_encode import FastEncoder
from .indexed import DataError, write_indexed
from .sft import preprocess_sft
from .tokenizer import Tokenizer

TASK_RECORD = "task.json"


def encode_documents(tokenizer: Tokenizer, texts: list[str], add_bos: bool = True, add_eos: bool = True,
                     batch: int = 1024):
    """Yield token lists ([BOS] ids [EOS]) with the exact fast encoder (or batched encoding)."""
    enc = FastEncoder(tokenizer)
    for s in range(0, len(texts), batch):
        chunk = texts[s:s + batch]
        for ids in enc.encode_batch(chunk):
            yield ([tokenizer.bos] if add_bos else []) + ids + ([tokenizer.eos] if add_eos else [])


def prepare(out: str | Path, texts: list[str] | None = None, *, tokenizer_path: str | None = None,
            vocab_size: int = 2048, num_math: int = 12000, num_stories: int = 12000, seed: int = 0,
            heldout: int = 128, num_arith: int | None = None, num_quests: int | None = None, log=print) -> dict:
    """Build (or reuse) the tokenizer and write ``out/corpus.{bin,idx}``; returns the manifest.

    Embedded corpus: ``num_arith`` defaults to ``num_math`` and ``num_quests`` to 2/3 of ``num_stories``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    spec = None
    if texts is None:
        spec = embedded_spec(num_math, num_stories, seed, heldout, num_arith, num_quests)
        docs = embedded_corpus(num_math, num_stories, seed, spec["num_arith"], spec["num_quests"])
        held, docs = split_heldout(docs, heldout)
        for task, fname in TASK_FILES.items():
            write_jsonl(held.get(task, []), out / "tasks" / fname)
        texts = [d["text"] for d in docs]
        if not texts:
            raise DataError(f"every generated document is held out (heldout={heldout} per task): raise the "
                            f"counts (--num-math, --num-stories, ...) or lower --heldout")
        log(f"generated {len(texts)} documents (+{heldout} held out per task) in {time.time() - t0:.1f}s")
    if not texts:
        raise DataError("the input holds no documents")
    if tokenizer_path:
        tok = Tokenizer.from_file(tokenizer_path)
    else:
        t1 = time.time()
        tok = Tokenizer.train(texts, vocab_size=vocab_size)
        log(f"trained byte-level BPE, vocab {tok.vocab_size}, in {time.time() - t1:.1f}s")
    tok.save(out / "tokenizer.json")
    t2 = time.time()
    info = {"hash": tok.hash, "vocab_size": tok.vocab_size, "special_ids": tok.special_ids}
    manifest = write_indexed(out / "corpus", encode_documents(tok, texts), tok.vocab_size, info)
    log(f"wrote {manifest['num_documents']} documents, {manifest['num_tokens']} tokens "
        f"({manifest['dtype']}) to {out / 'corpus'}.bin/.idx in {time.time() - t2:.1f}s")
    if spec is not None:
        (out / "embedded.json").write_text(json.dumps(spec, indent=1))
    return manifest


TASK_FILES = {"math": "math.jsonl", "story": "stories.jsonl", "arith": "arith.jsonl", "quest": "quests.jsonl"}


def embedded_spec(num_math: int, num_stories: int, seed: int, heldout: int, num_arith: int | None = None,
                  num_quests: int | None = None) -> dict:
    """What identifies an embedded corpus (written to ``embedded.json``, compared by ``--skip-existing``)."""
    return {"version": CORPUS_VERSION, **corpus_counts(num_math, num_stories, num_arith, num_quests), "seed": seed,
            "heldout": heldout}


def embedded_is_current(out: str | Path, given: dict | None = None) -> bool:
    """Whether ``out`` holds the current generator's corpus with every field of ``given`` (e.g. the counts
    passed on the command line) equal to the recorded one."""
    f = Path(out) / "embedded.json"
    try:
        spec = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return spec.get("version") == CORPUS_VERSION and all(spec.get(k) == v for k, v in (given or {}).items())


def prepare_from_files(out: str | Path, inputs: list[str], json_key: str = "text", **kw) -> dict:
    texts = [t for path in inputs for t in read_documents(path, json_key)]
    return prepare(out, texts, **kw)


def task_spec(task: str, knob: dict, fmt: str, seed: int, sizes: dict, tokenizer_path: str | None) -> dict:
    """What identifies a prepared task (``task.json``'s ``spec``, compared by ``--skip-existing``)."""
    return {"version": tasks.VERSION, "task": task, "knob": tasks.get(task).knob(knob), "format": fmt, "seed": seed,
            "sizes": dict(sizes), "tokenizer": tokenizer_path}


def task_is_current(out: str | Path, spec: dict) -> bool:
    try:
        return json.loads((Path(out) / TASK_RECORD).read_text()).get("spec") == spec
    except (OSError, ValueError):
        return False


def prepare_task(out: str | Path, spec: dict, workers: int = 2, log=print) -> dict:
    """Draw the splits of ``spec`` (:func:`task_spec`), check them (nothing of dev / test in train), write the
    records, the tokenizer and the train split as supervised data; returns the ``task.json`` record."""
    out, t0 = Path(out), time.time()
    task = tasks.get(spec["task"])
    problems, report = tasks.build_splits(task.name, spec["knob"], spec["seed"], spec["sizes"], workers, log)
    records = {s: [task.record(p, spec["format"]) for p in v] for s, v in problems.items()}
    report["check"] = tasks.check_heldout(records)
    if not records["train"]:
        raise DataError(f"task {task.name}: the train split is empty (--num-train)")
    if spec["tokenizer"]:
        tok = Tokenizer.from_file(spec["tokenizer"])
    else:
        tok = Tokenizer.characters(tasks.CHARACTERS, (tasks.SEP,))
        bad = {ch for rs in records.values() for r in rs for ch in r["prompt"].replace(tasks.SEP, "") + r["response"]
               if ch not in tasks.CHARACTERS}
        if bad:
            raise DataError(f"task {task.name}: characters outside the grid vocabulary {sorted(bad)[:5]}")
    for split, rs in records.items():
        write_jsonl(rs, out / f"{split}.jsonl")
    tok.save(out / "tokenizer.json")
    log(f"{task.name} {tasks.knob_tag(spec['knob'])}: " + ", ".join(f"{len(v)} {s}" for s, v in records.items())
        + f" problems drawn and checked in {time.time() - t0:.1f}s")
    manifest = preprocess_sft([str(out / "train.jsonl")], str(out / "corpus"), str(out / "tokenizer.json"),
                              chat_template=None if spec["format"] == "chat" else "none", workers=1, progress=False,
                              overwrite=True, log=log)
    layout = task.layout(spec["knob"]) if spec["format"] == "grid" and not spec["tokenizer"] else None
    record = {"spec": spec, "report": report, "num_documents": manifest["num_documents"],
              "num_tokens": manifest["num_tokens"],
              "layout": None if layout is None else {"prompt_chars": layout[0], "answer_chars": layout[1],
                                                     "document_tokens": layout[0] + layout[1] + 3,
                                                     "answer_start": layout[0] + 2}}
    (out / TASK_RECORD).write_text(json.dumps(record, indent=1))
    return record


__all__ = ["prepare_task", "task_spec", "task_is_current", "TASK_RECORD", "prepare", "prepare_from_files",
           "encode_documents", "embedded_spec", "embedded_is_current", "TASK_FILES"]
