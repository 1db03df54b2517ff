"""A rank's heartbeat: what it is doing, since when, and how long that may take before it counts as hung.

The training process writes one fixed-size record into an anonymous shared-memory file (``memfd``; a
temporary file where there is none) at every phase change; a watchdog process it spawned
(:mod:`.watchdog`, stdlib only, outside the training process so that a stopped or wedged trainer cannot
stop it) reads the record, publishes it for the other ranks and the supervisor, and kills the rank when
the record is older than its timeout. A beat is a ``struct.pack_into``: no system call, no file system.

Record (little-endian, :data:`RECORD`): ``seq`` u64 (a seqlock: odd while being written), ``step`` i64,
``beat`` f64 (``time.monotonic()``, one clock for every process of a host), ``wall`` f64 (``time.time()``,
comparable across hosts), ``timeout`` f64 (seconds; 0 = not watched), ``phase`` 56 bytes (UTF-8),
``collectives`` u64 (blocking collectives completed so far), ``inside`` 32 bytes (the collective the rank
is blocked in, empty when none: :meth:`Heartbeat.collective`). A rank stalled behind a hung peer is inside a
collective; the hung rank is not, or has completed fewer of them: that is how the watchdog names it.

Timeouts (:class:`Timeouts`): each phase kind (``startup``, ``step``, ``validate``, ``save``) gets
``fault.hang_timeout`` when that is set, else ``max(fault.hang_min_timeout, fault.hang_factor x the
longest duration measured for that kind so far)``, and ``fault.startup_timeout`` for a kind not measured
yet (the first step includes one-off work: allocator warm-up, the first collective's connections).
"""
from __future__ import annotations

import contextlib
import mmap
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RECORD = struct.Struct("<Qqddd56sQ32s")
KINDS = ("startup", "step", "validate", "save")


def read_record(buf) -> dict | None:
    """The record in ``buf`` (None while a write is in progress, after a few retries)."""
    for _ in range(100):
        seq, step, beat, wall, timeout, phase, count, inside = RECORD.unpack_from(buf, 0)
        if seq % 2 == 0 and RECORD.unpack_from(buf, 0)[0] == seq:
            return {"seq": seq, "step": step, "beat": beat, "wall": wall, "timeout": timeout,
                    "phase": phase.rstrip(b"\0").decode("utf-8", "replace"), "collectives": count,
                    "inside": inside.rstrip(b"\0").decode("utf-8", "replace")}
        time.sleep(0.0005)
    return None


class Timeouts:
    """The timeout of each phase kind, from measured durations (see the module docstring)."""

    def __init__(self, fixed: float, factor: float, minimum: float, startup: float):
        self.fixed, self.factor, self.minimum, self.startup = fixed, factor, minimum, startup
        self.longest: dict[str, float] = {}

    def measured(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)

    def __call__(self, kind: str) -> float:
        if self.fixed > 0 and kind != "startup":
            return self.fixed
        if kind not in self.longest:
            return self.startup
        return max(self.minimum, self.factor * self.longest[kind])


class Heartbeat:
    """The trainer's side: ``with heart.phase("step", step, "train step 41"):`` around every unit of work;
    ``close()`` stops the watchdog (a clean exit is never reported as a hang)."""

    def __init__(self, fc, rank: int, run_dir: Path):
        self.timeouts = Timeouts(fc.hang_timeout, fc.hang_factor, fc.hang_min_timeout, fc.startup_timeout)
        self.rank, self.seq, self.lock = rank, 0, threading.Lock()
        self.state = [-1, "startup", 0.0, 0.0, 0.0, 0, ""]     # step, phase, beat, wall, timeout, count, inside
        self.fd, path = _shared_file()
        self.buf = mmap.mmap(self.fd, RECORD.size)
        self.beat(-1, "startup", self.timeouts("startup"))
        out = Path(run_dir) / "heartbeats"
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "setdiff_mega.resilience.watchdog", "--fd", str(self.fd), "--parent",
               str(os.getpid()), "--rank", str(rank), "--out", str(out), "--poll", str(fc.heartbeat_poll)]
        self.proc = subprocess.Popen(cmd, pass_fds=(self.fd,), stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": _package_root()})
        if path is not None:
            os.unlink(path)                             # the watchdog holds it open: nothing left on disk

    def beat(self, step: int, phase: str, timeout: float) -> None:
        with self.lock:
            self.state[:5] = [step, phase, time.monotonic(), time.time(), timeout]
            self._write()

    def _write(self) -> None:
        step, phase, beat, wall, timeout, count, inside = self.state
        struct.pack_into("<Q", self.buf, 0, self.seq + 1)   # odd: being written
        RECORD.pack_into(self.buf, 0, self.seq + 1, step, beat, wall, timeout, phase.encode("utf-8")[:56], count,
                         inside.encode("utf-8")[:32])
        self.seq += 2
        struct.pack_into("<Q", self.buf, 0, self.seq)

    @contextlib.contextmanager
    def collective(self, name: str):
        """Around a blocking collective: the record says the rank is inside it (not the hang's cause)."""
        with self.lock:
            self.state[6] = name
            self._write()
        try:
            yield
        finally:
            with self.lock:
                self.state[5] += 1
                self.state[6] = ""
                self._write()

    @contextlib.contextmanager
    def phase(self, kind: str, step: int, what: str):
        self.beat(step, what, self.timeouts(kind))
        t0 = time.monotonic()
        yield
        self.timeouts.measured(kind, time.monotonic() - t0)
        self.beat(step, f"after {what}", self.timeouts("step"))   # between units: as long as a step may take

    def close(self, clean: bool = True) -> None:
        """Stop the watchdog; a clean exit says "finished", a failing one leaves the last phase on record."""
        if self.proc is not None:
            self.beat(*((-1, "finished") if clean else self.state[:2]), 0.0)
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR2)          # publish the last record, then exit
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        with contextlib.suppress(OSError, ValueError):
            self.buf.close()
            os.close(self.fd)


class NoHeartbeat:
    """``fault.watchdog=false``: the same interface, nothing watched."""

    @contextlib.contextmanager
    def phase(self, kind: str, step: int, what: str):
        yield

    @contextlib.contextmanager
    def collective(self, name: str):
        yield

    def close(self, clean: bool = True) -> None:
        pass


def start(fc, rank: int, run_dir) -> Heartbeat | NoHeartbeat:
    return Heartbeat(fc, rank, Path(run_dir)) if fc.watchdog else NoHeartbeat()


def _shared_file() -> tuple[int, str | None]:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("setdiff-heartbeat", 0)      # inheritable only through pass_fds
        path = None
    else:
        fd, path = tempfile.mkstemp(prefix="setdiff-heartbeat-")
    os.ftruncate(fd, RECORD.size)
    return fd, path


def _package_root() -> str:
    root = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH")
    return root if not rest else f"{root}{os.pathsep}{rest}"


__all__ = ["Heartbeat", "NoHeartbeat", "Timeouts", "read_record", "start", "RECORD", "KINDS"]
