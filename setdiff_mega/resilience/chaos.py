"""Fault injection for the chaos test (and for anyone who wants to see the restarts work on their cluster).

``SETDIFF_CHAOS=plan.json`` makes the trainer read a list of faults, each
``{"id": "f1", "kind": K, "step": S, "rank": R}``; rank R injects it when it reaches step S (before the
step's work; ``kill_in_save`` right after the checkpoint of step S was handed to its asynchronous writer):

* ``kill``          SIGKILL itself (a node lost);
* ``hang``          SIGSTOP itself (a wedged process: alive, holding its sockets, doing nothing);
* ``sleep``         sleep for ``seconds`` (default a day) inside the step, while its peers wait for it in
                    the gradient all-reduce (a hang inside a collective);
* ``kill_in_save``  SIGKILL itself while its asynchronous checkpoint writer is still writing;
* ``slow``          sleep ``seconds`` in every step from S on (a straggler; not a failure).

A fault other than ``slow`` fires once: before acting, the rank writes ``<plan>.fired/<id>.json``
(what, when: wall clock), so a restarted job does not meet it again, and the test reads the ledger.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

KINDS = ("kill", "hang", "sleep", "kill_in_save", "slow")


class Chaos:
    def __init__(self, plan: Path, rank: int):
        self.plan, self.rank = Path(plan), rank
        faults = json.loads(self.plan.read_text())
        bad = [f for f in faults if f.get("kind") not in KINDS]
        if bad:
            raise ValueError(f"{plan}: fault kind {bad[0].get('kind')!r} is not one of {', '.join(KINDS)}")
        self.faults = [f for f in faults if int(f["rank"]) == rank]
        self.ledger = self.plan.with_name(self.plan.name + ".fired")
        self.ledger.mkdir(exist_ok=True)

    @classmethod
    def from_env(cls, rank: int) -> "Chaos | None":
        plan = os.environ.get("SETDIFF_CHAOS")
        return cls(Path(plan), rank) if plan else None

    def _claim(self, fault: dict, step: int) -> bool:
        mark = self.ledger / f"{fault['id']}.json"
        if mark.exists():
            return False
        mark.write_text(json.dumps({**fault, "fired_step": step, "fired_wall": time.time(), "pid": os.getpid()}))
        return True

    def before_step(self, step: int) -> None:
        """At the start of (0-based) ``step``."""
        for f in self.faults:
            if f["kind"] == "slow" and step >= int(f["step"]):
                time.sleep(float(f.get("seconds", 0.05)))
            elif f["kind"] in ("kill", "hang", "sleep") and int(f["step"]) == step and self._claim(f, step):
                self._act(f)

    def after_save(self, step: int) -> None:
        """Right after the checkpoint of ``step`` (steps done) was scheduled."""
        for f in self.faults:
            if f["kind"] == "kill_in_save" and int(f["step"]) == step and self._claim(f, step):
                self._act(f)

    @staticmethod
    def _act(fault: dict) -> None:
        kind = fault["kind"]
        if kind in ("kill", "kill_in_save"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(float(fault.get("seconds", 86400.0)))


__all__ = ["Chaos", "KINDS"]
