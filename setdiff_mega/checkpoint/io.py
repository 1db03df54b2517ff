"""The checkpoint directory protocol: atomic publication, a ``latest`` pointer, keep-last-K, integrity checks.

Layout of ``<save_dir>/checkpoints/``:

    step_0000400/                 one complete checkpoint
        dist/                     model (+ AdamW) shards, megatron-core dist_checkpointing (torch_dist)
        zero/                     DeepSpeed ZeRO optimizer shards (only when ZeRO owns the optimizer)
        rng/rank_00000.pt ...     RNG states of every rank (torch, mcore model-parallel tracker, python)
        config.yaml               the full resolved RunConfig
        tokenizer.json            the tokenizer the model was trained with (+ its special-token sidecar)
        state.json                step, consumed samples, layout, metrics, and the size (and SHA-256) of every
                                  file above
    latest                        names the newest complete checkpoint; written last, atomically; a hint for
                                  people and scripts: resolution reads the step directories (latest_checkpoint)

Saving writes ``step_<step>.tmp/`` and renames it to ``step_<step>/`` only when every rank has
finished, and ``state.json`` is the last file written inside it: a directory with that name and a
``state.json`` is complete by construction, and an interrupted save (a crash, SIGKILL, a full disk)
leaves only a ``.tmp`` directory that is never read and is removed by the next save. ``state.json``
lists the byte size of every file, and (``train.checkpoint_checksums``, on by default; cheap for the
shard sizes of small runs, off-switchable for huge ones) its SHA-256, both verified on load: a
checkpoint truncated later (a bad copy) or with a flipped bit (same size) is reported with the file's
name instead of failing, or silently loading wrong numbers, inside a deserializer. All ranks must see
the same filesystem.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from setdiff_mega.errors import CheckpointError
from setdiff_mega.hfmodel.integrity import sha256_file

FORMAT = "setdiff-mega/ckpt-v2"
STEP_GLOB = "step_???????"




def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoints_root(save_dir: str | Path) -> Path:
    return Path(save_dir) / "checkpoints"


def staging_dir(save_dir: str | Path, step: int) -> Path:
    """Where the ranks write step ``step`` before it is published (same name on every rank)."""
    return checkpoints_root(save_dir) / f"step_{step:07d}.tmp"


def prepare_staging(save_dir: str | Path, step: int) -> Path:
    """Rank 0: an empty staging directory for ``step`` (a leftover from an interrupted save is removed)."""
    tmp = staging_dir(save_dir, step)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def file_sizes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def file_digests(root: Path) -> dict:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def publish(tmp: Path, state: dict, keep_last: int = 2, checksums: bool = True) -> Path:
    """Rank 0, after every rank has written into ``tmp``: seal, rename into place, point ``latest`` at it."""
    root = tmp.parent
    final = root / tmp.name[: -len(".tmp")]
    meta = {"format": FORMAT, **state, "files": file_sizes(tmp), **({"sha256": file_digests(tmp)} if checksums else {})}
    write_text_atomic(tmp / "state.json", json.dumps(meta, indent=2))
    _fsync_dir(tmp)
    if final.exists():                      # re-saving the same step: move the old one aside first
        old = root / f"{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    write_text_atomic(root / "latest", final.name + "\n")
    for stale in root.glob(f"{STEP_GLOB}.tmp"):          # interrupted saves of other steps
        shutil.rmtree(stale, ignore_errors=True)
    done = complete_checkpoints(root)
    for old in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    return sorted(q for q in root.glob(STEP_GLOB) if (q / "state.json").is_file())


def latest_checkpoint(path: str | Path) -> Path | None:
    """Resolve a run directory, a checkpoints/ directory or a step directory to a complete checkpoint.

    The newest complete ``step_N`` directory wins; ``latest`` is only a hint. A save killed between the
    rename of ``step_N.tmp`` and the rewrite of ``latest`` leaves a complete ``step_N`` while ``latest``
    still names the previous step: reading the pointer would resume from the older one and lose the steps
    in between. The one window without any complete ``step_N`` (re-saving the only kept step, between moving
    the old copy aside and renaming the new one in) is covered by the aside copy ``step_N.old-<pid>``.
    """
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    done = complete_checkpoints(root)
    if done:
        return done[-1]
    aside = sorted(q for q in root.glob(f"{STEP_GLOB}.old-*") if (q / "state.json").is_file())
    return aside[-1] if aside else None


def read_state(ck: Path, verify: bool = True) -> dict:
    """state.json of a complete checkpoint; with ``verify``, every listed file must exist with its size."""
    f = ck / "state.json"
    try:
        state = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"'{ck}' is not a complete checkpoint (no state.json)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"'{f}' is corrupt ({e.msg}); use an earlier checkpoint") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"'{f}' has format {state.get('format')!r}, this version reads {FORMAT!r}")
    if verify:
        for rel, size in state.get("files", {}).items():
            q = ck / rel
            if not q.is_file():
                raise CheckpointError(f"checkpoint file '{q}' is missing; the checkpoint is incomplete (copy it again "
                                      f"or use an earlier one)")
            actual = q.stat().st_size
            if actual != size:
                raise CheckpointError(f"checkpoint file '{q}' is truncated or modified: {actual} bytes, "
                                      f"{size} when saved; copy it again or use an earlier checkpoint")
        if state.get("sha256"):
            for rel, digest in state["sha256"].items():
                if sha256_file(ck / rel) != digest:
                    raise CheckpointError(f"checkpoint file '{ck / rel}' does not match the SHA-256 recorded when it "
                                          f"was saved (same size: corrupted in place); copy it again or use an "
                                          f"earlier checkpoint")
    return state


def resolve_checkpoint(path: str | Path) -> tuple[Path, dict]:
    """(directory, verified state.json) of the checkpoint that ``path`` names; errors name the path."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path '{p}' does not exist")
    ck = latest_checkpoint(p)
    if ck is None:
        raise CheckpointError(f"no complete checkpoint at '{p}' (expected state.json in a step_* directory or a "
                              f"'latest' pointer under checkpoints/; '.tmp' directories are interrupted saves)")
    return ck, read_state(ck)


__all__ = ["CheckpointError", "FORMAT", "latest_checkpoint", "resolve_checkpoint", "read_state", "publish",
           "prepare_staging", "staging_dir", "checkpoints_root", "write_text_atomic", "complete_checkpoints"]
