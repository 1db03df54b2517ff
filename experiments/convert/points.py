"""The conversion study's finished results, one small JSON file each, in a directory committed to the repository.

A **point** is one finished measurement: an arm's training record (its validation loss), a dev or test accuracy,
a held-out NLL. Its **key** names what it measures::

    {"kind": "train" | "accuracy" | "nll", "arm": "setdlm_D4/base", "seed": 0, "task": "arithmetic",
     "knob": "max_value50_steps2", "split": "dev" | "test" | "kjv" | "", "setting": {sampler fields} | {},
     "train": <the run's id: sha of the config file, the parent, the training overrides>}

and its file is ``<dir>/<kind>/<sha256 of the key, 20 hex>.json``, written atomically
(:func:`setdiff_mega.outputs.write_file_atomic`), holding ``{"key", "value", "provenance": {"code", "commit",
"config"}}``: the code fingerprint (:func:`experiments.provenance.fingerprint` of what the value depends on),
the commit it was computed at and the fine-tuning config's sha256. :meth:`PointStore.get` returns a stored value
only when the key **and** the code fingerprint of its kind and the config hash match; anything else is recomputed
(and the file replaced). The store's ``code`` is one fingerprint for every kind or {kind: fingerprint}
(:func:`code_fingerprints`: a change of the decoding code invalidates accuracies, not trainings). Timings are never
points: they depend on the machine and are measured again in the final report run.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from experiments.provenance import DECODING_CODE, fingerprint, git_commit
from setdiff_mega.outputs import write_file_atomic

KINDS = ("train", "accuracy", "nll")
TRAIN_CODE = ("training", "model", "diffusion", "data", "tasks", "checkpoint", "config", "parallel", "compat",
              "methods.py", "train.py", "backends.py", "build.py")
DECODE_CODE = (*DECODING_CODE, "model", "diffusion", "tasks", "checkpoint")
NLL_CODE = ("eval/likelihood.py", "eval/heldout.py", "model", "diffusion", "checkpoint", "data/tokenizer.py")


@functools.lru_cache(maxsize=1)
def code_fingerprints() -> dict:
    """{kind: fingerprint} of the point kinds (``experiments/convert/evaluate.py``'s docstring says what each
    covers)."""
    here = Path(__file__).parent
    studies = here.parent
    train = fingerprint(TRAIN_CODE, extra=(here / "data.py", here / "train.py", here / "points.py",
                                           studies / "paper" / "frontier.py"))
    decode = fingerprint(DECODE_CODE, extra=(here / "evaluate.py", studies / "planning" / "evaluate.py"))
    nll = fingerprint(NLL_CODE, extra=(here / "evaluate.py",))
    both = lambda other: hashlib.sha256(f"{train}/{other}".encode()).hexdigest()[:16]
    return {"train": train, "accuracy": both(decode), "nll": both(nll)}


def point_key(kind: str, arm: str, seed: int, task: str, knob: str, split: str = "", setting: dict | None = None,
              train: str = "") -> dict:
    """The key of a point (module docstring); ``kind`` one of :data:`KINDS`."""
    if kind not in KINDS:
        raise ValueError(f"point kind {kind!r} is not one of {', '.join(KINDS)}")
    return {"kind": kind, "arm": arm, "seed": int(seed), "task": task, "knob": knob, "split": split,
            "setting": dict(sorted((setting or {}).items())), "train": train}


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclass
class PointStore:
    """Points under ``root`` (module docstring), valid for the code fingerprint ``code`` (one string, or
    {kind: fingerprint}) and config hash ``config``."""
    root: Path
    code: str | dict
    config: str

    def code_of(self, kind: str) -> str:
        return self.code[kind] if isinstance(self.code, dict) else self.code

    def path(self, key: dict) -> Path:
        return Path(self.root) / key["kind"] / f"{key_hash(key)}.json"

    def get(self, key: dict) -> dict | None:
        """The stored value of ``key``, or None when absent, unreadable or computed by other code / config."""
        f = self.path(key)
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        prov = rec.get("provenance") or {}
        if rec.get("key") != key or prov.get("code") != self.code_of(key["kind"]) or prov.get("config") != self.config:
            return None
        return {**rec["value"], "computed_at": {"commit": prov.get("commit"), "code": prov["code"]}}

    def put(self, key: dict, value: dict) -> dict:
        """Store ``value`` under ``key``; returns it with its ``computed_at`` (commit, code)."""
        value = {k: v for k, v in value.items() if k != "computed_at"}
        prov = {"code": self.code_of(key["kind"]), "commit": git_commit(), "config": self.config}
        rec = {"key": key, "value": value, "provenance": prov}
        write_file_atomic(self.path(key), json.dumps(rec, indent=1, sort_keys=True, default=str) + "\n")
        return {**value, "computed_at": {"commit": prov["commit"], "code": prov["code"]}}

    def get_or(self, key: dict, compute) -> dict:
        """The stored value, or ``compute()`` stored and returned."""
        got = self.get(key)
        return got if got is not None else self.put(key, compute())

    def all(self) -> list[dict]:
        """Every readable point record under the root (any provenance), for the report."""
        out = []
        for f in sorted(Path(self.root).glob("*/*.json")):
            try:
                out.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def current(self) -> list[dict]:
        """The records valid for this code and config."""
        return [r for r in self.all() if (r.get("provenance") or {}).get("code") == self.code_of(r["key"]["kind"])
                and r["provenance"].get("config") == self.config]


__all__ = ["KINDS", "PointStore", "point_key", "key_hash", "code_fingerprints", "TRAIN_CODE", "DECODE_CODE",
           "NLL_CODE"]
