"""Single-process checkpoints, written atomically and published by a ``latest`` pointer.

Layout of ``<save_dir>/checkpoints/``:

    step_0000400/            one complete checkpoint (published by an atomic directory rename)
        model.pt             model state_dict (fp32)
        optimizer.pt         optimizer state_dict
        state.json           step, consumed samples, metrics, format version
        rng.pt               torch CPU RNG state, the data-noise generator state, mcore tracker states
        config.yaml          the full resolved RunConfig
        tokenizer.json       the tokenizer the model was trained with
    latest                   text file naming the newest complete checkpoint (written last, atomically)

A save first writes ``step_<7-digit step>.tmp-<pid>/`` and renames it into place, so an interrupted save never
replaces or corrupts a good checkpoint. ``keep_last`` prunes older complete checkpoints.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

FORMAT = "setdiff-mega/ckpt-v1"


class CheckpointError(ValueError):
    """A missing, incomplete or mismatched checkpoint; the message names the file."""


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(save_dir: str | Path, step: int, *, model=None, model_state: dict | None = None,
                    optimizer=None, config=None, tokenizer_file: str | Path | None = None,
                    state: dict | None = None, rng: dict | None = None, keep_last: int = 2) -> Path:
    """Write a complete checkpoint for ``step`` and publish it; returns its directory.

    Weights come from ``model.state_dict()`` or, for a model-parallel run, an already gathered
    single-process ``model_state``.
    """
    if (model is None) == (model_state is None):
        raise ValueError("save_checkpoint needs exactly one of model= or model_state=")
    from setdiff_mega.config import dump_yaml

    root = Path(save_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(model.state_dict() if model_state is None else model_state, tmp / "model.pt")
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if rng is not None:
        torch.save(rng, tmp / "rng.pt")
    if config is not None:
        dump_yaml(config, tmp / "config.yaml")
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
    meta = {"format": FORMAT, "step": step, **(state or {})}
    (tmp / "state.json").write_text(json.dumps(meta, indent=2))
    if final.exists():                      # re-saving the same step: move the old one aside first
        old = root / f"{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _write_text_atomic(root / "latest", final.name + "\n")
    done = sorted(p for p in root.glob("step_???????") if p.is_dir())
    for old in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(path: str | Path) -> Path | None:
    """Resolve a run directory, a checkpoints/ directory or a step directory to a complete checkpoint."""
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if (cand / "state.json").is_file():
            return cand
    done = sorted(q for q in root.glob("step_???????") if (q / "state.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: str | Path) -> dict:
    """Load {dir, state, config, model (state_dict), optimizer, rng} from a checkpoint path."""
    from setdiff_mega.config import ConfigError, load_config

    ck = latest_checkpoint(path)
    if ck is None:
        raise CheckpointError(f"no complete checkpoint at '{path}' (expected state.json in a step_* directory "
                              f"or a 'latest' pointer under checkpoints/)")
    try:
        state = json.loads((ck / "state.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"'{ck / 'state.json'}' is corrupt ({e.msg})") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"'{ck}' has format {state.get('format')!r}, expected {FORMAT!r}")
    out = {"dir": ck, "state": state}
    try:
        out["config"] = load_config(ck / "config.yaml", check=False)
    except ConfigError as e:
        raise CheckpointError(f"'{ck / 'config.yaml'}': {e}") from None
    for name in ("model", "optimizer", "rng"):
        f = ck / f"{name}.pt"
        if f.is_file():
            try:
                out[name] = torch.load(f, map_location="cpu", weights_only=False)
            except Exception as e:
                raise CheckpointError(f"'{f}' is truncated or unreadable ({type(e).__name__}: {e})") from None
        elif name == "model":
            raise CheckpointError(f"checkpoint '{ck}' has no model.pt")
    return out


def load_model(path: str | Path):
    """Rebuild the model, objective and tokenizer of a checkpoint: (model, objective, tokenizer, config)."""
    from setdiff_mega.data.tokenizer import Tokenizer
    from setdiff_mega.model import build_model
    from setdiff_mega.parallel import initialize
    from setdiff_mega.training.trainer import objective_from_config

    ck = load_checkpoint(path)
    initialize(seed=ck["config"].train.seed)     # no-op when the caller already set up parallel state
    cfg = ck["config"]
    tok = Tokenizer.from_file(ck["dir"] / "tokenizer.json")
    vocab = cfg.model.vocab_size or tok.vocab_size
    model = build_model(cfg.model, vocab)
    missing = set(model.state_dict()) ^ set(ck["model"])
    if missing:
        raise CheckpointError(f"'{ck['dir'] / 'model.pt'}' does not match the model in its config.yaml "
                              f"(differing keys: {sorted(missing)[:5]})")
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor) and v.shape != ck["model"][k].shape:
            raise CheckpointError(f"'{ck['dir'] / 'model.pt'}': tensor {k} has shape "
                                  f"{tuple(ck['model'][k].shape)}, the model expects {tuple(v.shape)}")
    model.load_state_dict(ck["model"])
    model.tokenizer_hash = tok.hash          # generation refuses any other tokenizer
    return model, objective_from_config(cfg, tok), tok, cfg


__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "load_model", "FORMAT"]
