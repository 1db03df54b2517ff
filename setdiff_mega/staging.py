"""Staging directories that name their owner, and the safe removal of the ones a dead invocation left behind.

A tool that writes through a staging directory (:func:`setdiff_mega.outputs.staged_dir`, preprocessing's
``<out>.tmp-<tag>-<n>``) names its owner twice: in the directory's name, ``<tag>`` = :func:`owner_tag`
(``<host hash>-<pid>-<start, centiseconds>``, there from the ``mkdir`` on, so a run killed before it wrote anything
else is still recognised), and in a record inside it, ``.owner.json``::

    {"host": socket.gethostname(), "pid": os.getpid(), "started": the process's start time (psutil)}

A later invocation writing the same output looks at the staging siblings of earlier ones
(:func:`sweep_leftovers`) and classifies each by :func:`owner_state`:

    dead      same host, and no process with that pid, or one that started at another time (pid reused)
    alive     same host, the same process still running (a concurrent invocation: never touched)
    unknown   another host (a shared file system: liveness cannot be proven from here), or neither a readable
              record nor a tag in the name (a leftover of an older version, or a directory someone else made)

Only ``dead`` ones are removed (each with one log line); the others are reported and left alone. A ``kill -9``
cannot clean up after itself, so this is the only place its leftovers can go.

Temporary *files* (:func:`setdiff_mega.outputs.write_file_atomic`) carry their owner in their name instead,
``.<name>.owner-<host hash>-<pid>-<start, centiseconds>.<random>.tmp`` (:func:`file_prefix`), and
:func:`sweep_files` applies the same rule to them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import tempfile
import zlib
from pathlib import Path

import psutil

OWNER = ".owner.json"


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def record_owner(directory: Path) -> None:
    """Write this process as the owner of ``directory`` (a staging directory it just created)."""
    pid = os.getpid()
    (Path(directory) / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid,
                                                     "started": _started(pid)}))


def make_staging(parent: Path, prefix: str) -> Path:
    """A fresh ``parent / (prefix + tag + random)`` directory owned by this process (mode 0777 & ~umask)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-", dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())
    record_owner(tmp)
    return tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def owner_state(directory: Path) -> tuple[str, str]:
    """(dead | alive | unknown, who: a few words for the log) of a staging directory (module docstring)."""
    try:
        rec = json.loads((Path(directory) / OWNER).read_text())
        host, pid, started = rec["host"], int(rec["pid"]), rec.get("started")
    except (OSError, ValueError, KeyError, TypeError):
        tag = TAG.search(Path(directory).name)
        if tag is None:
            return "unknown", "no owner record"
        return _tag_state(*tag.groups())
    who = f"pid {pid} on {host}"
    if host != socket.gethostname():
        return "unknown", who + " (another host)"
    now = _started(pid)
    if now is None or (started is not None and abs(now - float(started)) > 1.0):
        return "dead", who
    return "alive", who


def sweep_leftovers(parent: Path, prefixes: tuple, log=None) -> tuple[list, list]:
    """Remove the staging directories under ``parent`` whose names start with one of ``prefixes`` and whose
    owner is provably dead; report the others. Returns (removed, kept)."""
    log = log or (lambda m: print(m, file=sys.stderr))
    removed, kept = [], []
    if not Path(parent).is_dir():
        return removed, kept
    for d in sorted(Path(parent).iterdir()):
        if not (d.is_dir() and not d.is_symlink() and d.name.startswith(prefixes)):
            continue
        state, who = owner_state(d)
        if state == "dead":
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            log(f"removed '{d}', left by an interrupted run ({who}, no longer running)")
        else:
            kept.append(d)
            log(f"left '{d}' alone: its owner is {'still running' if state == 'alive' else 'unknown'} ({who}); "
                f"remove it by hand once no run uses it")
    return removed, kept


def _host() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def owner_tag() -> str:
    """``<host hash>-<pid>-<start time, centiseconds>`` of this process: the owner, in a name (module docstring)."""
    pid = os.getpid()
    return f"{_host()}-{pid}-{round((_started(pid) or 0.0) * 100)}"


TAG = re.compile(r"-([0-9a-f]{8})-(\d+)-(\d+)-")       # an owner tag inside a staging directory's name


def _tag_state(host: str, pid: str, started: str) -> tuple[str, str]:
    """:func:`owner_state` of the owner a tag names (the same rule: the start times agree within 1 s)."""
    who = f"pid {pid} (from the name)"
    if host != _host():
        return "unknown", who + " (another host)"
    now = _started(int(pid))
    if now is None or abs(round(now * 100) - int(started)) > 100:
        return "dead", who
    return "alive", who


def file_prefix(name: str) -> str:
    """The temporary-file prefix that names this process as the owner (module docstring)."""
    return f".{name}.owner-{owner_tag()}."


def sweep_files(parent: Path, name: str, log=None) -> list:
    """Remove ``parent``'s temporary files for ``name`` whose owner (in the file name) is provably dead on this
    host; returns them (the others are left alone)."""
    log = log or (lambda m: print(m, file=sys.stderr))
    removed = []
    pattern = re.compile(re.escape(f".{name}.owner-") + r"([0-9a-f]{8})-(\d+)-(\d+)\..*\.tmp$")
    if not Path(parent).is_dir():
        return removed
    for f in sorted(Path(parent).iterdir()):
        m = pattern.match(f.name)
        if m and f.is_file() and _tag_state(*m.groups())[0] == "dead":
            f.unlink(missing_ok=True)
            removed.append(f)
            log(f"removed '{f}', left by an interrupted run (pid {m.group(2)}, no longer running)")
    return removed


__all__ = ["OWNER", "record_owner", "make_staging", "owner_state", "owner_tag", "sweep_leftovers", "file_prefix",
           "sweep_files"]
