"""Where a study's numbers came from: the code that computed them and the commit it was at.

A cached result (an accuracy, a timing) is keyed by everything its value depends on; the code is one of those
things. :func:`fingerprint` is the SHA-256 (16 hex) over the named sources, each hashed with its path relative to
its root, so an edit, a rename or a new file among them changes it; :data:`DECODING_CODE` lists what a decoded
answer depends on (the samplers, the export's model and decode step, the options, the engine, the request
encoding, the chat rendering and the tokenizer wrapper). :func:`git_commit` names the commit a result was computed
at, with ``+dirty`` when tracked files had uncommitted changes, so a report prints where its cached numbers were
computed instead of stamping its own commit on them.
"""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import setdiff_mega

PACKAGE = Path(setdiff_mega.__file__).resolve().parent
# what a decoded answer depends on (relative to the setdiff_mega package; a folder: its *.py, recursively)
DECODING_CODE = ("decoding", "hfmodel", "inference/options.py", "inference/api.py", "inference/engine.py",
                 "eval/tasks.py", "data/chat.py", "data/tokenizer.py")


def fingerprint(paths: tuple = DECODING_CODE, root: Path = PACKAGE, extra: tuple = ()) -> str:
    """sha256 (16 hex) of the sources ``paths`` under ``root`` and the files ``extra`` (module docstring)."""
    h = hashlib.sha256()
    for rel in paths:
        p = Path(root) / rel
        if not p.exists():
            raise FileNotFoundError(f"'{p}' is not there: the code fingerprint lists a source that moved")
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(f"{f.relative_to(root).as_posix()}\0".encode() + f.read_bytes() + b"\0")
    for f in extra:
        h.update(f"{Path(f).name}\0".encode() + Path(f).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def git_commit(where: Path = PACKAGE) -> str:
    """The short commit of the checkout holding ``where``, with ``+dirty`` for uncommitted changes to tracked
    files ("" outside a checkout)."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=where, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    c = git("rev-parse", "--short", "HEAD")
    return c + ("+dirty" if c and git("status", "--porcelain", "--untracked-files=no") else "")


def computed_at(points: list[dict]) -> str:
    """The commits and code fingerprints a report's cached points were computed at (``computed_at`` of each), with
    their counts."""
    n: dict = {}
    for p in points:
        c = p.get("computed_at") or {"commit": "an unrecorded commit (cached before computed_at)", "code": "?"}
        k = f"{c['commit'] or 'no checkout'} (code {c['code']})"
        n[k] = n.get(k, 0) + 1
    return "; ".join(f"{k}: {v} points" for k, v in sorted(n.items())) or "no points"


__all__ = ["PACKAGE", "DECODING_CODE", "fingerprint", "git_commit", "computed_at"]
