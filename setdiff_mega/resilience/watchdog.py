"""The watchdog of one rank: a separate process (stdlib only) that reads the rank's heartbeat record
(:mod:`.heartbeat`) every ``poll`` seconds, publishes it as ``<run>/heartbeats/rank-NNNNN.json`` (for the
other ranks' watchdogs and the supervisor), and, when the record is older than its timeout, names the
hung rank in one line, records it in ``<run>/heartbeats/hang.json`` and SIGKILLs the rank it watches.

Which rank hung: every rank blocked in a collective behind a stalled peer stops beating too. Among the
published records of this attempt the culprit is a rank whose process is stopped (state ``T``: SIGSTOP, a
debugger), else a rank outside every collective (:mod:`.collectives`; its own work stalled while the others
wait for it), the one with the fewest completed collectives (it is behind), then the oldest beat; the line
names it, its host, what it was doing, and how long the detecting rank waited.
Detection comes within ``timeout + poll`` of the last beat (``poll`` is capped at a quarter of the timeout).
A pause of the whole job is not a hang: when the watchdog itself did not run for more than half the timeout
beyond its poll (the process group stopped with SIGSTOP and continued, a suspended VM), the rank's stall is
counted from the watchdog's return, so the rank gets its full timeout to beat again; a rank stopped alone, its
watchdog running, is still named and killed.
Killing the rank ends the step everywhere: its peers' collectives fail at once, or their own watchdogs
fire within their timeouts.

    python -m setdiff_mega.resilience.watchdog --fd FD --parent PID --rank R --out DIR --poll S
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import sys
import time
from pathlib import Path

from setdiff_mega.lifeline import tie_to_parent
from setdiff_mega.resilience.heartbeat import RECORD, read_record


def write_json(path: Path, record: dict, tag: str = "") -> None:
    """``record`` into ``path`` atomically (a temporary sibling of this writer's, renamed)."""
    tmp = path.with_name(f".{path.name}.tmp{tag}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def publish(out: Path, rank: int, record: dict) -> None:
    write_json(out / f"rank-{rank:05d}.json", record)


def published(out: Path, attempt: int, since: float) -> list[dict]:
    """Every rank's record of this attempt (the supervisor's restart count, and a watchdog started after
    ``since``: a record an earlier job left behind is not this job's)."""
    found = []
    for p in sorted(out.glob("rank-*.json")):
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if r.get("attempt") == attempt and r.get("started", 0) >= since:
            found.append(r)
    return found


def culprit(records: list[dict], mine: dict) -> dict:
    """The hung rank's record (see the module docstring), ``mine`` included."""
    pool = {r["rank"]: r for r in records}
    pool[mine["rank"]] = mine
    stopped = [r for r in pool.values() if r.get("state") in ("T", "t")]
    outside = [r for r in pool.values() if not r.get("inside")]
    return min(stopped or outside or pool.values(), key=lambda r: (r.get("collectives", 0), r["wall"], r["rank"]))


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, ...; "?" where /proc is not there)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def hang_line(hung: dict, me: dict, stalled: float) -> str:
    who = f"rank {hung['rank']} (host {hung['host']}, pid {hung['pid']})"
    doing = f"'{hung['phase']}'"
    if hung.get("state") in ("T", "t"):
        how = "its process is stopped (SIGSTOP or a debugger)"
    elif hung.get("inside"):
        how = f"inside {hung['inside']} after {hung.get('collectives', 0)} collectives"
    else:
        how = f"outside any collective after {hung.get('collectives', 0)}, while its peers wait for it"
    by = "" if hung["rank"] == me["rank"] else f"; rank {me['rank']} waited {stalled:.1f}s in '{me['phase']}'"
    return (f"error: hang: {who} stopped making progress in {doing} ({how}): no heartbeat for "
            f"{time.time() - hung['wall']:.1f}s (timeout {me['timeout']:.1f}s, fault.hang_timeout){by}; "
            f"ending the job so that it can restart from the newest checkpoint")


class Watch:
    """The loop (:meth:`run`); :meth:`stop` (SIGUSR2: the trainer's close()) publishes a last time."""

    def __init__(self, fd: int, parent: int, rank: int, out: Path, poll: float):
        self.buf = mmap.mmap(fd, RECORD.size, access=mmap.ACCESS_READ)
        self.parent, self.rank, self.out, self.poll = parent, rank, out, poll
        self.host, self.started = socket.gethostname(), time.time()
        self.attempt = int(os.environ.get("SETDIFF_RESTART_COUNT", "0") or 0)

    def mine(self, rec: dict) -> dict:
        return {"rank": self.rank, "host": self.host, "pid": self.parent, "attempt": self.attempt,
                "started": self.started, "step": rec["step"], "phase": rec["phase"], "wall": rec["wall"],
                "timeout": rec["timeout"], "collectives": rec["collectives"], "inside": rec["inside"],
                "state": process_state(self.parent)}

    def run(self) -> None:
        watching = last = time.monotonic()    # since when this watchdog has run without a break (module docstring)
        wait, timeout = self.poll, 0.0
        while True:
            now = time.monotonic()
            if timeout > 0 and now - last > wait + timeout / 2:
                watching = now                # this watchdog did not run either: a pause of the job, not a hang
            last = now
            rec = read_record(self.buf)
            wait = self.poll
            if rec is not None:
                timeout = rec["timeout"]
                mine = self.mine(rec)
                publish(self.out, self.rank, mine)
                stalled = now - max(rec["beat"], watching)
                if timeout > 0 and stalled > timeout:
                    self.hung(mine, stalled)
                    return
                if timeout > 0:
                    wait = min(self.poll, timeout / 4)
            time.sleep(wait)

    def hung(self, mine: dict, stalled: float) -> None:
        hung = culprit(published(self.out, self.attempt, self.started - 600), mine)
        line = hang_line(hung, mine, stalled)
        print(line, file=sys.stderr, flush=True)
        record = {"detected_wall": time.time(), "detected_by": self.rank, "attempt": self.attempt,
                  "rank": hung["rank"], "host": hung["host"], "pid": hung["pid"], "step": hung["step"],
                  "phase": hung["phase"], "inside": hung.get("inside", ""), "state": hung.get("state", "?"),
                  "timeout": mine["timeout"], "stalled_s": stalled,
                  "last_beat_wall": hung["wall"], "line": line}
        try:
            first = json.loads((self.out / "hang.json").read_text()).get("detected_wall", 0) < self.started
        except (OSError, ValueError):
            first = True
        if first:                                   # the first detection of this attempt is the one on record
            write_json(self.out / "hang.json", record, f"-{self.rank}")
        os.kill(self.parent, signal.SIGKILL)

    def stop(self, *_) -> None:
        rec = read_record(self.buf)
        if rec is not None:
            publish(self.out, self.rank, self.mine(rec))
        os._exit(0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--poll", type=float, default=1.0)
    a = p.parse_args(argv)
    # the signals a launcher or a terminal sends the rank's process group are the trainer's to handle (a SIGTERM'd
    # rank saves before it exits: still watched); the trainer's close() ends the watchdog with SIGUSR2
    tie_to_parent(a.parent, ignore=(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))
    w = Watch(a.fd, a.parent, a.rank, a.out, a.poll)
    signal.signal(signal.SIGUSR2, w.stop)
    w.run()


if __name__ == "__main__":
    main()
