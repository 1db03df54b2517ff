"""``train.init_from=hf:DIR``: start training directly from a Hugging Face directory (any supported family).

The trainer's process group is the run's layout (TP / PP / CP), while an import builds the TP = 1 model in
one process (:func:`~setdiff_mega.checkpoint.families.import_model`), so the import runs in a child process
of its own (no launcher variables, no GPU) and writes a weights-only native checkpoint once, which every
rank then loads like any ``train.init_from`` checkpoint (in the run's layout, by megatron-core's
distributed checkpointing):

    <train.save_dir>/init_from_hf/<key>/checkpoints/step_0000000

``key`` = sha256 over the directory's config and tokenizer files (their bytes), its weight files' names,
sizes and modification times, and the import's options (the run's objective name): a later start of the run
(or a resume) reuses the import, a changed directory gets a new one. Before any process group exists, the
launcher's rank 0 imports and the other ranks wait for its checkpoint (or its one-line failure, which they
raise too: a note ``<key>.failed-<time>-<pid>`` per failed attempt, never removed; a waiting rank reads only
the notes of its own start). The run's tokenizer must be the import's (the data is checked against it as usual): prepare
the data with the adopted tokenizer (``tools/convert_checkpoint.py from-hf`` writes it, or
``tools/train_tokenizer.py --from-tokenizer``).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from setdiff_mega.errors import USER_ERRORS
from setdiff_mega.parallel.state import discover_launcher_env

from .families import import_model
from .io import CheckpointError, latest_checkpoint

PREFIX = "hf:"
TEXT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json")
WEIGHTS = ("*.safetensors", "*.bin", "*.index.json")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS")
WAIT_S = 4 * 3600.0                  # the other ranks' patience with rank 0's import


def is_hf(init_from: str | None) -> bool:
    return bool(init_from) and str(init_from).startswith(PREFIX)


def content_key(src: Path, objective: str) -> str:
    """sha256 of the directory's config / tokenizer bytes, its weights' names, sizes and mtimes and the options."""
    h = hashlib.sha256(f"objective={objective}\n".encode())
    for name in TEXT_FILES:
        f = src / name
        if f.is_file():
            h.update(f"{name}\n".encode() + f.read_bytes())
    for pattern in WEIGHTS:
        for f in sorted(src.glob(pattern)):
            st = f.stat()
            h.update(f"{f.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["CUDA_VISIBLE_DEVICES"] = ""          # the import builds the model on the CPU
    return env


def _import(src: Path, out: Path, objective: str, failed: Path) -> None:
    """Rank 0: the import in a child process; its one-line error becomes ours (and the other ranks')."""
    proc = subprocess.run([sys.executable, "-m", "setdiff_mega.checkpoint.hf_init", str(src), str(out), objective],
                          env=_child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
        message = lines[-1].removeprefix("error: ") if lines else f"exit status {proc.returncode}"
        message = f"train.init_from=hf:{src}: the import failed: {message}"
        note = failed.parent / f"{failed.name}-{int(time.time() * 1e6)}-{os.getpid()}"   # this attempt's own
        note.write_text(json.dumps({"message": message, "time": time.time()}))
        raise CheckpointError(message)


def _wait(out: Path, failed: Path, started: float, timeout: float) -> None:
    """Other ranks: until rank 0's checkpoint is published, or its failure note (of this start) appears."""
    while latest_checkpoint(out) is None:
        for f in sorted(failed.parent.glob(f"{failed.name}-*")):      # rank 0's notes; earlier attempts' are old
            note = json.loads(f.read_text())
            if note.get("time", 0) >= started - 60:
                raise CheckpointError(note["message"])
        if time.time() - started > timeout:
            raise CheckpointError(f"rank 0 did not finish importing into '{out}' within {timeout:.0f} s; check "
                                  f"its log, or import once with tools/convert_checkpoint.py from-hf")
        time.sleep(1.0)


def resolve_init(cfg, log=print, timeout: float = WAIT_S) -> str | None:
    """``train.init_from`` as a native checkpoint path: ``hf:DIR`` is imported (once, see the module
    docstring) and its checkpoint returned; anything else is returned unchanged."""
    init = cfg.train.init_from
    if not is_hf(init):
        return init
    src = Path(init[len(PREFIX):]).expanduser()
    if not (src / "config.json").is_file():
        raise CheckpointError(f"train.init_from={init}: '{src / 'config.json'}' does not exist; name a local "
                              f"Hugging Face model directory (config.json, weights, tokenizer.json)")
    started = time.time()
    key = content_key(src, cfg.objective.name)
    root = Path(cfg.train.save_dir) / "init_from_hf"
    out, failed = root / key, root / f"{key}.failed"
    if latest_checkpoint(out) is not None:
        return str(out)
    env = discover_launcher_env()
    if env is None or int(env["RANK"]) == 0:
        root.mkdir(parents=True, exist_ok=True)
        log(f"importing {src} for train.init_from into {out} (once; later starts reuse it)")
        _import(src, out, cfg.objective.name, failed)
    else:
        _wait(out, failed, started, timeout)
    return str(out)


def main(argv=None) -> int:
    """The child: ``python -m setdiff_mega.checkpoint.hf_init SRC OUT OBJECTIVE``."""
    src, out, objective = argv if argv is not None else sys.argv[1:]
    try:
        import_model(src, out, [f"objective.name={objective}"])
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
