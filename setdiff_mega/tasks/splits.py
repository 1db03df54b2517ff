"""Train / dev / test splits held out by computation, and the check that nothing of dev or test is in training data.

**Assignment.** A problem's split is a function of its group alone (``base.py``: the string two problems share when
they share a computation or a reference answer)::

    u = first 8 bytes of sha256("setdiff-tasks/v1/<task>/<group>") / 2^64
    test if u < 0.1;  dev if u < 0.2;  train otherwise

The salt is fixed and the knob and seed are not in it: a computation is in the same split at every seed and every
knob setting, so datasets drawn at other seeds or difficulties never leak into each other's test sets either.

**Drawing.** Each split is drawn from its own random stream, ``random.Random("<task>/<knob tag>/<seed>/<split>/<c>")``
for chunks c = 0, 1, ... of ``CHUNK`` attempts; a generator rejects a draw whose group hashes into another split as
soon as the group is known. The chunks' problems are taken in chunk order, the first of every key only, until the
split has its size: the result depends on (task, knob, seed, size) only, not on the number of worker processes, and
dev / test do not change when the training size does. When ``PATIENCE`` attempts in a row bring nothing new the
space is exhausted and the split keeps what it has (``exhausted`` in the report: e.g. 2 x 2 digit multiplication
has about 4,000 computations in all).

**Check** (:func:`check_heldout`, run on every dataset written and by the unit tests): the splits' keys and groups
are disjoint, and no dev or test string of :meth:`~.base.Task.heldout_strings` (the response it would be trained
on; for most tasks also the bare reference answer) occurs in any training record's text, as a whole token: not
inside a longer run of letters or digits (``391`` inside ``13910`` is another number).
"""
from __future__ import annotations

import hashlib
import random
import re
from multiprocessing import get_context

from .base import Problem, TaskError, knob_tag
from .registry import get

SALT = "setdiff-tasks/v1"
FRACTIONS = (("test", 0.1), ("dev", 0.1))          # the rest: train
SPLITS = ("train", "dev", "test")
CHUNK = 64
PATIENCE = 4096


def split_of(task: str, group: str) -> str:
    """The split of a group (module docstring)."""
    h = hashlib.sha256(f"{SALT}/{task}/{group}".encode()).digest()
    u, edge = int.from_bytes(h[:8], "big") / 2.0 ** 64, 0.0
    for name, frac in FRACTIONS:
        edge += frac
        if u < edge:
            return name
    return "train"


def _chunk(args) -> list:
    """Worker: the problems (None for a rejected or failed attempt) of chunk ``c`` of a split's stream."""
    name, knob, stream, split, c = args
    task, rng = get(name), random.Random(f"{stream}/{c}")
    accept = lambda group: split_of(name, group) == split
    return [task.generate(knob, rng, accept) for _ in range(CHUNK)]


def _chunks(job, workers: int):
    """The chunks job(0), job(1), ... in order: in this process, or ``workers`` at a time in a process pool."""
    c = 0
    if workers <= 1:
        while True:
            yield _chunk(job(c))
            c += 1
    with get_context("fork").Pool(workers) as pool:
        while True:
            yield from pool.map(_chunk, [job(c + i) for i in range(2 * workers)])
            c += 2 * workers


def draw(task_name: str, knob: dict, split: str, n: int, seed: int, workers: int = 1) -> tuple[list, bool]:
    """(``n`` problems of ``split`` with distinct keys, exhausted): module docstring."""
    stream = f"{task_name}/{knob_tag(knob)}/{seed}/{split}"
    out, seen, misses = [], set(), 0
    if n <= 0:
        return out, False
    for chunk in _chunks(lambda c: (task_name, knob, stream, split, c), workers):
        for p in chunk:
            if p is None or p.key in seen:
                misses += 1
            else:
                seen.add(p.key)
                out.append(p)
                misses = 0
            if len(out) == n or misses >= PATIENCE:
                return out, len(out) < n
    raise AssertionError("unreachable")


def build_splits(task_name: str, knob: dict, seed: int, sizes: dict, workers: int = 1, log=print) -> tuple[dict, dict]:
    """({split: [Problem]}, report) for ``sizes`` = {split: count}; the report holds each split's count, whether its
    space ran out, and the fractions and salt of the assignment."""
    task = get(task_name)
    knob = task.knob(knob)
    out, report = {}, {"task": task_name, "knob": knob, "seed": seed, "salt": SALT, "fractions": dict(FRACTIONS),
                       "splits": {}}
    for split in SPLITS:
        probs, exhausted = draw(task_name, knob, split, int(sizes.get(split, 0)), seed, workers)
        out[split] = probs
        report["splits"][split] = {"requested": int(sizes.get(split, 0)), "problems": len(probs),
                                   "exhausted": exhausted}
        if exhausted:
            log(f"note: {task_name} {knob_tag(knob)}: the {split} split's space is exhausted at {len(probs)} distinct "
                f"problems (asked {sizes.get(split)})")
    return out, report


def _whole(s: str) -> re.Pattern:
    """``s`` as a whole token: no letter or digit right before or after it."""
    lead = r"(?<![0-9A-Za-z])" if s[:1].isalnum() else ""
    tail = r"(?![0-9A-Za-z])" if s[-1:].isalnum() else ""
    return re.compile(lead + re.escape(s) + tail)


def check_heldout(records: dict) -> dict:
    """Raise TaskError if a dev / test key or group is a training one, or a dev / test held-out string occurs in a
    training record's prompt or response; ``records``: {split: [record]} (``Task.record``). Returns the counts."""
    keys = {s: {r["key"] for r in records.get(s, [])} for s in SPLITS}
    groups = {s: {r["group"] for r in records.get(s, [])} for s in SPLITS}
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        for what, sets in (("key", keys), ("group", groups)):
            both = sets[a] & sets[b]
            if both:
                raise TaskError(f"{len(both)} {what}s are in both the {a} and the {b} split (e.g. {sorted(both)[0]!r})")
    train = "\n".join(r["prompt"] + "\n" + r["response"] for r in records.get("train", []))
    checked = 0
    for split in ("dev", "test"):
        for r in records.get(split, []):
            task = get(r["task"])
            for s in task.heldout_strings(Problem.from_dict(r), r):
                checked += 1
                if s and s in train and _whole(s).search(train):
                    raise TaskError(f"a {split} string occurs in the training data: {s[:80]!r} (key {r['key'][:60]!r})")
    return {"keys": {s: len(v) for s, v in keys.items()}, "groups": {s: len(v) for s, v in groups.items()},
            "heldout_strings_checked": checked, "leaks": 0}


__all__ = ["split_of", "draw", "build_splits", "check_heldout", "SALT", "FRACTIONS", "SPLITS"]
