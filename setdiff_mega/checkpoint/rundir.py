"""A run directory belongs to one run at a time, and which run a tool loads from it is never ambiguous.

:func:`claim` runs once at the start of training, on every rank, before anything is written to
``train.save_dir``:

* rank 0 takes the directory's lock (:class:`setdiff_mega.outputs.RunLock`: ``<save_dir>/.lock``, held
  until the run ends, released by the kernel if the process dies): a second run in the same directory
  stops with one line naming the holder's PID and host;
* it decides what this run continues (:func:`find_resume`: ``train.resume`` = auto | none | a path) and
  refuses to mix two histories in one directory: a new run (``resume=none``, or a checkpoint elsewhere)
  in a ``save_dir`` that holds complete checkpoints, or a resume from an older checkpoint of this
  directory while newer ones exist, is refused unless ``train.overwrite=true``, which first removes what
  the old history's trainer wrote (its checkpoints, or the newer ones; ``metrics.jsonl``,
  ``summary.json``, ``loss_curve.png``, ``tensorboard/`` for a new run). Nothing else in the directory is
  touched;
* its decision (or its one-line error) reaches every rank through a broadcast, so all ranks stop alike.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from setdiff_mega.outputs import OutputError, RunLock

from .io import (
    CheckpointError,
    checkpoints_root,
    complete_checkpoints,
    latest_checkpoint,
    read_state,
    resolve_checkpoint,
)

RUN_FILES = ("metrics.jsonl", "summary.json", "loss_curve.png", "tensorboard")   # what a trainer writes


def find_resume(cfg) -> tuple[Path, dict] | None:
    """The checkpoint ``train.resume`` names (auto: the newest complete one in save_dir, or None)."""
    want = cfg.train.resume
    if want in (None, "", "none"):
        return None
    if want == "auto":
        ck = latest_checkpoint(checkpoints_root(Path(cfg.train.save_dir)))
        return None if ck is None else (ck, read_state(ck))
    return resolve_checkpoint(want)


def _conflicts(save_dir: Path, found) -> tuple[list[Path], str, bool]:
    """(checkpoints of another history in ``save_dir``, why, whether this run starts a new history there)
    for a run that continues ``found``."""
    root = checkpoints_root(save_dir)
    done = complete_checkpoints(root) if root.is_dir() else []
    if found is None:
        return done, "this run starts from scratch (train.resume=none)", True
    ck = Path(found[0]).resolve()
    if ck.parent != root.resolve():
        return done, f"this run continues '{found[0]}', which is not one of them", True
    newer = [d for d in done if d.name > ck.name]
    return newer, f"this run resumes the older '{ck.name}': its next saves would mix two histories", False


def _remove_history(save_dir: Path, stale: list[Path], fresh_run: bool) -> None:
    for d in stale:
        shutil.rmtree(d)
    if not fresh_run:
        return
    root = checkpoints_root(save_dir)
    (root / "latest").unlink(missing_ok=True)
    for leftover in [*root.glob("step_???????.tmp"), *root.glob("step_???????.old-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    for name in RUN_FILES:
        p = save_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def _decide(cfg) -> tuple[RunLock, tuple | None]:
    """Rank 0: lock, resolve the resume, enforce one history per directory."""
    save_dir = Path(cfg.train.save_dir)
    if save_dir.exists() and not save_dir.is_dir():
        raise OutputError(f"train.save_dir '{save_dir}' is a file; point train.save_dir at a directory (new or "
                          f"holding this run)")
    lock = RunLock(save_dir).acquire()
    try:
        found = find_resume(cfg)
        stale, why, fresh = _conflicts(save_dir, found)
        if stale:
            names = ", ".join(d.name for d in stale[-3:])
            if not cfg.train.overwrite:
                raise CheckpointError(f"train.save_dir '{save_dir}' holds checkpoints of another run history "
                                      f"({names}) and {why}: use a new train.save_dir, continue that run with "
                                      f"train.resume=auto, or pass train.overwrite=true to remove them first")
            _remove_history(save_dir, stale, fresh)
        return lock, found
    except BaseException:
        lock.release()
        raise


def claim(cfg, rank: int) -> tuple[RunLock | None, tuple | None]:
    """Collective: (rank 0's lock or None, the checkpoint this run continues or None); the same one-line
    error on every rank when the directory may not be used."""
    lock = found = error = None
    if rank == 0:
        try:
            lock, found = _decide(cfg)
        except Exception as e:              # every rank must hear of it, or the others wait forever
            error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [None if error is None else (type(error).__name__, str(error))]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            error = (OutputError if box[0][0] == "OutputError" else CheckpointError)(box[0][1])
    if error is not None:
        raise error
    return lock, found if rank == 0 else find_resume(cfg)


__all__ = ["claim", "find_resume", "RUN_FILES"]
