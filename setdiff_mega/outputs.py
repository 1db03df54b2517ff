"""Where tools write, and the rules that keep what a user already has safe.

Every tool that writes (conversions, preprocessing, ``generate --out``, evaluation reports, sweeps, the
reproduction, benchmarks) goes through this module:

1. **An output is never an input.** An output path may not equal an input path nor contain one (be
   one of its ancestor directories): ``to-hf runs/exp1 runs`` is refused before anything happens.
2. **Nothing existing is replaced without being asked, and never what another tool or a person made.**
   An existing non-empty output is refused with one line unless ``--overwrite`` is given; even then only
   a previous output of the *same* tool (``owned``: the tool's own marker or files) is replaced, never a
   source, an ancestor of a source, or an unrelated directory. Tools that continue their own earlier
   output by design (sweeps, the reproduction) accept it without ``--overwrite`` and refuse anything else.
3. **Outputs appear whole.** A directory output is written into a fresh staging directory next to it
   (``.<name>.staging-<random>``, unique to this invocation, naming its owner: :mod:`setdiff_mega.staging`,
   which also removes the ones a dead invocation left) and renamed into place; a replaced previous
   output is moved aside first and removed only once the new one is in place. A file output is written
   to a unique sibling and renamed. A failure leaves the previous output (or nothing) in place.

Directory outputs carry a marker, ``.setdiff-mega-output.json`` (``{"tool": ...}``), which is how a later
invocation recognises its own work.

:class:`RunLock` is the advisory lock (``fcntl.flock`` on ``<dir>/.lock``, released by the kernel when
the holder dies, so ``kill -9`` leaves no stale lock) that makes a run directory belong to one run at a
time; the lock file names the holder's PID, host and start time for the one-line refusal.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from setdiff_mega.errors import OutputError
from setdiff_mega.staging import OWNER, file_prefix, make_staging, sweep_files, sweep_leftovers

MARKER = ".setdiff-mega-output.json"




def _resolved(p: str | Path) -> Path:
    return Path(os.path.abspath(os.path.expanduser(str(p))))


def _contains(parent: Path, child: Path) -> bool:
    return parent == child or parent in child.parents


def check_not_input(out: str | Path, inputs: Iterable, flag: str) -> Path:
    """``out`` (resolved) unless it equals or contains one of ``inputs`` (paths; None entries ignored)."""
    o = _resolved(out)
    for i in inputs:
        if i is None or str(i) in ("", "-"):
            continue
        src = _resolved(i)
        for cand in {src, Path(os.path.realpath(src))}:
            if _contains(o, cand) or _contains(Path(os.path.realpath(o)), cand):
                what = "is" if o == cand else "contains"
                raise OutputError(f"{flag} '{out}' {what} the input '{i}': writing there would replace it; choose "
                                  f"an output path outside the inputs")
    return o


def _parent_ok(o: Path, flag: str, out) -> None:
    for a in [o.parent, *o.parent.parents]:
        if a.exists():
            if not a.is_dir():
                raise OutputError(f"{flag} '{out}' is under '{a}', which is a file, not a directory; choose "
                                  f"another path")
            return


def is_nonempty_dir(p: Path) -> bool:
    return p.is_dir() and any(p.iterdir())


def read_marker(d: Path) -> dict | None:
    try:
        return json.loads((Path(d) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def marked_by(tool: str) -> Callable[[Path], bool]:
    """An ``owned`` predicate: the directory carries this tool's marker."""
    return lambda d: (read_marker(d) or {}).get("tool") == tool


def write_marker(d: Path, tool: str, **info) -> None:
    (Path(d) / MARKER).write_text(json.dumps({"tool": tool, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                              **info}) + "\n")


def check_output_dir(out: str | Path, inputs: Iterable = (), *, flag: str, tool: str, overwrite: bool = False,
                     owned: Callable[[Path], bool] | None = None, continues: bool = False) -> Path:
    """Validate a directory output before any work (rules 1 and 2); returns the resolved path.

    ``owned(dir)``: whether an existing directory is a previous output of this tool (default: its marker).
    ``continues``: the tool continues its own earlier output (no ``--overwrite`` needed for that)."""
    o = check_not_input(out, inputs, flag)
    owned = owned or marked_by(tool)
    _parent_ok(o, flag, out)
    if o.exists() and not o.is_dir():
        raise OutputError(f"{flag} '{out}' is an existing file; {tool} writes a directory there: choose a new "
                          f"directory")
    if is_nonempty_dir(o):
        mine = owned(o)
        if not mine:
            raise OutputError(f"{flag} '{out}' is a non-empty directory that {tool} did not write; it is never "
                              f"replaced: choose a new directory (or empty this one yourself)")
        if not (overwrite or continues):
            raise OutputError(f"{flag} '{out}' already holds an earlier output of {tool}: choose a new directory, "
                              f"or pass --overwrite to replace it")
    return o


def claim_output_dir(out: str | Path, inputs: Iterable = (), *, flag: str, tool: str, overwrite: bool = False,
                     owned: Callable[[Path], bool] | None = None, continues: bool = False, **info) -> Path:
    """:func:`check_output_dir`, then create the directory and mark it as this tool's when it is new (for
    tools that write into their output directory in place, file by file)."""
    o = check_output_dir(out, inputs, flag=flag, tool=tool, overwrite=overwrite, owned=owned, continues=continues)
    if not is_nonempty_dir(o):
        o.mkdir(parents=True, exist_ok=True)
        write_marker(o, tool, **info)
    return o


def holds_only(*suffixes: str) -> Callable[[Path], bool]:
    """An ``owned`` predicate for directories written before markers existed: every file in it (recursively)
    has one of these suffixes (a tool's CSV / PNG / JSON reports)."""
    return lambda d: all(f.suffix in suffixes for f in Path(d).rglob("*") if f.is_file())


def either(*predicates: Callable[[Path], bool]) -> Callable[[Path], bool]:
    return lambda d: any(p(d) for p in predicates)


@contextlib.contextmanager
def staged_dir(out: str | Path, tool: str, **marker):
    """Yield a fresh staging directory next to ``out``; on success it is renamed to ``out`` (a previous
    output there, already validated by :func:`check_output_dir`, is moved aside and removed after the
    rename). On failure the staging directory is removed and ``out`` is untouched."""
    o = _resolved(out)
    o.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(o.parent, (f".{o.name}.staging-", f".{o.name}.replaced-"))   # a dead run's (staging.py)
    tmp = make_staging(o.parent, f".{o.name}.staging-")
    try:
        yield tmp
        (tmp / OWNER).unlink(missing_ok=True)
        write_marker(tmp, tool, **marker)
        aside = None
        if o.exists():
            aside = make_staging(o.parent, f".{o.name}.replaced-")
            os.replace(o, aside / o.name)
        os.replace(tmp, o)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_file(out: str | Path, inputs: Iterable = (), *, flag: str, overwrite: bool = False) -> Path:
    """Validate a file output before any work: not an input or an ancestor of one, not a directory, under
    a directory, and (unless ``overwrite``) not an existing file."""
    o = check_not_input(out, inputs, flag)
    _parent_ok(o, flag, out)
    if o.is_dir():
        raise OutputError(f"{flag} '{out}' is a directory; give a file path (e.g. '{Path(out) / 'out.json'}')")
    if o.exists() and not overwrite:
        raise OutputError(f"{flag} '{out}' exists: choose a new file, or pass --overwrite to replace it")
    return o


def usual_mode(path, mode: int = 0o666) -> None:
    """chmod ``path`` to ``mode`` under the process umask (what ``open`` would have given it)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def write_file_atomic(out: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to a unique sibling of ``out`` and rename it into place."""
    o = _resolved(out)
    o.parent.mkdir(parents=True, exist_ok=True)
    sweep_files(o.parent, o.name)                 # a dead run's temporary file of this output (staging.py)
    fd, tmp = tempfile.mkstemp(prefix=file_prefix(o.name), suffix=".tmp", dir=o.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        usual_mode(tmp)
        os.replace(tmp, o)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return o


class RunLock:
    """An exclusive advisory lock on a directory (``<dir>/.lock``, ``fcntl.flock``): one holder at a time,
    released on :meth:`release` or by the kernel when the holder's process dies."""

    NAME = ".lock"

    def __init__(self, directory: str | Path, what: str = "run directory", field: str = "train.save_dir"):
        self.dir, self.what, self.field = Path(directory), what, field
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / self.NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"{self.field} '{self.dir}' is in use by another run ({self._holder(path)}); a "
                              f"{self.what} belongs to one run at a time: wait for it to finish, stop it, or choose "
                              f"another {self.field}") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode() + b"\n")
        self.fd = fd
        return self

    @staticmethod
    def _holder(path: Path) -> str:
        try:
            h = json.loads(path.read_text())
            return f"PID {h['pid']} on host {h['host']}, since {h['started']}"
        except (OSError, ValueError, KeyError):
            return "holder unknown"

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


__all__ = ["OutputError", "MARKER", "check_not_input", "check_output_dir", "claim_output_dir", "holds_only",
           "either", "check_output_file", "staged_dir", "write_file_atomic", "usual_mode", "write_marker",
           "read_marker", "marked_by", "is_nonempty_dir", "RunLock"]
