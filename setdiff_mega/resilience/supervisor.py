"""Automatic in-job restarts (``launch.sh --max-restarts N``): run the launcher's command (torchrun, srun,
mpirun, deepspeed) and, when it fails, run it again, resuming from the newest complete checkpoint
(``train.resume=auto`` is appended on every restart), up to N times.

After a failure the supervisor reads what the ranks left in ``<train.save_dir>/heartbeats/`` (:mod:`.watchdog`):
the step each rank was in (the job's failure position is the earliest), and ``hang.json`` when a watchdog
ended the attempt; it prints one line per restart and appends a record per failure to
``<train.save_dir>/restarts.jsonl`` (node 0's supervisor): attempt, exit status, reason, step, the
checkpoint resumed from, the steps recomputed and the attempt's duration. The trainer logs the restart count as
``fault/restarts`` (``SETDIFF_RESTART_COUNT``).

It stops instead of restarting when

* the command exited 0, or the supervisor itself was told to stop (SIGTERM / SIGUSR1 are passed on to the
  command, whose ranks save and stop; SIGINT reaches the command from the terminal directly);
* the command exited with status 2 (a refusal: a bad config, missing or mismatched data: not transient);
* ``fault.max_same_step_failures`` failures in a row happened at the same step (a bad batch, a NaN, a
  bug: restarting would loop), with that reason;
* N restarts are used up.

Every node of a multi-node job runs its own supervisor over its own launcher; they read the same files and
so decide alike, and restart ``k`` rendezvous on ``MASTER_PORT + k`` (:func:`on_port`: a node that restarts
first would otherwise join the previous attempt's store, still open on the other node, and its stale
rendezvous). Under
Slurm one supervisor around ``srun`` in the batch script restarts every node's tasks at once.

    python -m setdiff_mega.supervise --max-restarts N -- torchrun ... pretrain/pretrain.py ARGS   (the entry point)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .watchdog import published

PRETRAIN = ("pretrain/pretrain.py", "setdiff_mega.train", "setdiff-pretrain")


def pretrain_args(cmd: list[str]) -> list[str] | None:
    """The trainer's arguments in a launcher command (after ``pretrain/pretrain.py``), None if absent."""
    for i, a in enumerate(cmd):
        if a.endswith(PRETRAIN[0]) or a in PRETRAIN[1:]:
            return cmd[i + 1:]
    return None


def on_port(cmd: list[str], env: dict, attempt: int) -> tuple[list[str], dict]:
    """The command and environment of restart ``attempt``: the rendezvous port moved to MASTER_PORT + attempt
    (``--master_port`` / ``--master-port`` of torchrun and deepspeed, ``-genv MASTER_PORT`` of mpirun, the
    variable for srun), so that a node restarting before another has closed the last attempt's store never
    joins that stale rendezvous."""
    cmd, env = list(cmd), dict(env)
    if attempt == 0:
        return cmd, env
    for i in range(len(cmd) - 1):
        if cmd[i] in ("--master_port", "--master-port") or (cmd[i] == "MASTER_PORT" and cmd[i - 1] == "-genv"):
            cmd[i + 1] = str(int(cmd[i + 1]) + attempt)
    env["MASTER_PORT"] = str(int(env.get("MASTER_PORT", "29500")) + attempt)
    return cmd, env


def completed_steps(rec: dict) -> int:
    """Steps a rank had finished when it last beat: ``train step N`` is N - 1, everything else (``after ...``,
    ``save at step N``, ``validate at step N``) N; set-up is -1."""
    if rec["step"] < 0:
        return -1
    return rec["step"] - 1 if rec["phase"].startswith("train step") else rec["step"]


def describe(save_dir: Path, attempt: int, started: float, rc: int) -> dict:
    """What ended this attempt: the earliest rank's position, the hang if a watchdog saw one, the checkpoint a
    restart resumes from."""
    from setdiff_mega.checkpoint.io import checkpoints_root, latest_checkpoint, read_state

    beats = published(save_dir / "heartbeats", attempt, started - 1)
    done = min((completed_steps(r) for r in beats), default=-1)
    ck = latest_checkpoint(checkpoints_root(save_dir)) if checkpoints_root(save_dir).is_dir() else None
    resume = int(read_state(ck)["step"]) if ck is not None else 0
    hang = None
    try:
        h = json.loads((save_dir / "heartbeats" / "hang.json").read_text())
        if h.get("attempt") == attempt and h.get("detected_wall", 0) >= started:
            hang = h
    except (OSError, ValueError):
        pass
    if hang is not None:
        reason = (f"rank {hang['rank']} (host {hang['host']}) hung in '{hang['phase']}' (detected after "
                  f"{hang['stalled_s']:.1f}s, timeout {hang['timeout']:.1f}s)")
    else:
        reason = f"the job exited with status {rc}" + ("" if done < 0 else f" during step {done + 1}")
    return {"attempt": attempt, "exit_status": rc, "reason": reason, "failed_at_step": done + 1 if done >= 0 else None,
            "completed_steps": done, "resume_from": str(ck) if ck is not None else None, "resume_step": resume,
            "steps_recomputed": max(done - resume, 0), "hang": hang, "wall": time.time(),
            "attempt_seconds": time.time() - started}


class Supervisor:
    """``cfg``: the run's config (its save_dir and fault.*), parsed from the command as the trainer will."""

    def __init__(self, cmd: list[str], cfg, max_restarts: int, node_rank: int = 0, delay: float = 1.0, log=None):
        self.cmd, self.max_restarts, self.node_rank, self.delay = cmd, max_restarts, node_rank, delay
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.proc: subprocess.Popen | None = None
        self.stopping = False
        self.save_dir, self.same_step = Path(cfg.train.save_dir), cfg.fault.max_same_step_failures

    def _signal(self, signum, _frame) -> None:
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None and signum != signal.SIGINT:
            self.proc.send_signal(signum)

    def run(self) -> int:
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(s, self._signal)
        failures: list[dict] = []
        attempt = 0
        while True:
            cmd, env = on_port(self.cmd if attempt == 0 else [*self.cmd, "train.resume=auto"], dict(os.environ),
                               attempt)
            started = time.time()
            self.proc = subprocess.Popen(cmd, env={**env, "SETDIFF_RESTART_COUNT": str(attempt)})
            rc = self.proc.wait()
            if rc == 0 or self.stopping:
                return rc
            if rc == 2:
                self.log("supervisor: the job was refused (exit status 2: a config or data error, see above): not "
                         "restarting")
                return rc
            failure = describe(self.save_dir, attempt, started, rc)
            failures.append(failure)
            self._record(failure)
            why = self._give_up(failures)
            if why:
                self.log(f"error: supervisor: {why}; not restarting (fix the cause, then launch again: the run "
                         f"resumes from {failure['resume_from'] or 'the start'})")
                return rc or 1
            attempt += 1
            self.log(f"supervisor: restart {attempt}/{self.max_restarts}: {failure['reason']}; resuming from "
                     f"{failure['resume_from'] or 'the start'} (step {failure['resume_step']}, "
                     f"{failure['steps_recomputed']} steps to recompute)")
            time.sleep(self.delay)

    def _give_up(self, failures: list[dict]) -> str | None:
        last = failures[-1]
        if len(failures) > self.max_restarts:
            return f"{last['reason']}, and all {self.max_restarts} restarts (--max-restarts) are used up"
        tail = failures[-self.same_step:]
        if len(tail) == self.same_step and len({f["completed_steps"] for f in tail}) == 1:
            where = "during set-up" if last["completed_steps"] < 0 else f"at step {last['completed_steps'] + 1}"
            return (f"the last {self.same_step} attempts failed {where} ({last['reason']}): a failure that "
                    f"repeats at the same step is not transient (bad data, a non-finite loss, a bug; "
                    f"fault.max_same_step_failures={self.same_step})")
        return None

    def _record(self, failure: dict) -> None:
        if self.node_rank != 0:
            return
        self.save_dir.mkdir(parents=True, exist_ok=True)
        with open(self.save_dir / "restarts.jsonl", "a") as f:
            f.write(json.dumps(failure) + "\n")


__all__ = ["Supervisor", "describe", "on_port", "pretrain_args", "completed_steps"]
