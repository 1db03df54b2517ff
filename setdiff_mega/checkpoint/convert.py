"""Conversions between a native checkpoint and the Hugging Face format of :mod:`.hf`:
``export`` (native -> ``config.json`` + ``generation_config.json`` (the decoding defaults) +
``model.safetensors`` (fp32, bit-exact, or bf16) + tokenizer + the code of ``setdiff_mega/hfmodel`` and
``setdiff_mega/decoding`` (flattened) + a model card
``README.md`` + ``SHA256SUMS`` (verified on load); written into a staging directory of this invocation
and renamed into place) and ``import_export`` (an export -> a weights-only native checkpoint). Kept
apart from the format so that loading (``native.load_model``, which reads exports) and converting
(which loads models) do not import each other.

Both refuse outputs that would destroy something (:mod:`setdiff_mega.outputs`): an output that is or
contains the input, an existing non-empty directory without ``overwrite``, and, even with it, anything
that is not a previous output of the same conversion (an export; a directory of weights-only imports).
A training run's checkpoints are never replaced by an import.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from setdiff_mega import methods
from setdiff_mega.decoding.base import GenerationConfig
from setdiff_mega.hfmodel.generation_setdlm import GENERATION_FILE
from setdiff_mega.outputs import (
    OutputError,
    check_not_input,
    check_output_dir,
    is_nonempty_dir,
    marked_by,
    staged_dir,
    usual_mode,
)

from . import hf
from .card import model_card
from .io import CheckpointError, checkpoints_root, complete_checkpoints, read_state, resolve_checkpoint
from .native import load_model, save_model_checkpoint

DTYPES = {"fp32": ("float32", torch.float32), "bf16": ("bfloat16", torch.bfloat16)}


TO_HF = "convert_checkpoint to-hf"


def _is_export(d: Path) -> bool:
    """A previous output of ``to-hf`` (its marker, or an export written before markers existed)."""
    try:
        return marked_by(TO_HF)(d) or hf.is_hf_export(d)
    except CheckpointError:
        return False


def export(checkpoint: str | Path, out_dir: str | Path, weights: str | None = None, dtype: str = "fp32",
           overwrite: bool = False) -> Path:
    """Write the Hugging Face directory of a native checkpoint; ``weights``: ema | raw | None (the EMA when
    the checkpoint has one); ``dtype``: fp32 (bit-exact) | bf16; ``overwrite``: replace a previous export
    at ``out_dir`` (never anything else)."""
    if dtype not in DTYPES:
        raise CheckpointError(f"export dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    check_output_dir(out_dir, [checkpoint], flag="out_dir", tool=TO_HF, overwrite=overwrite, owned=_is_export)
    ck, state = resolve_checkpoint(checkpoint)
    check_not_input(out_dir, [ck], "out_dir")
    model, _, tok, cfg = load_model(ck, weights=weights)
    with staged_dir(out_dir, TO_HF, source=str(ck)) as tmp:
        _write_export(tmp, model, tok, cfg, state, ck, dtype)
    return Path(out_dir)


def _write_export(tmp: Path, model, tok, cfg, state: dict, ck: Path, dtype: str) -> None:
    name, torch_dtype = DTYPES[dtype]
    tensors = {k: v.to(torch_dtype).contiguous() for k, v in hf.native_to_hf(model.state_dict(), cfg.model).items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "producer": "setdiff-mega"})
    usual_mode(tmp / "model.safetensors")          # safetensors writes 0600: an export is meant to be shared
    decoding = {**asdict(GenerationConfig()), **methods.decoding_defaults(cfg.objective, cfg.data.seq_length)}
    meta = {**hf.hf_config(cfg, tok, model.padded_vocab_size), "torch_dtype": name,
            "setdiff_mega_step": int(state.get("step", 0)), "setdiff_mega_weights": model.weights_kind,
            "setdiff_generation": decoding}
    _write_json(tmp / "config.json", meta)
    sample = decoding["temperature"] > 0          # greedy: no temperature / top_p (transformers flags them)
    _write_json(tmp / GENERATION_FILE, {"bos_token_id": tok.bos, "eos_token_id": tok.eos, "pad_token_id": tok.pad,
                                         "do_sample": sample, **{k: v for k, v in decoding.items()
                                                                 if sample or k not in ("temperature", "top_p")}})
    tok.save(tmp / "tokenizer.json")
    special = {"bos_token": tok.token(tok.bos), "eos_token": tok.token(tok.eos), "pad_token": tok.token(tok.pad),
               "mask_token": tok.token(tok.mask)}
    _write_json(tmp / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast",
                                                "model_max_length": cfg.model.max_position_embeddings, **special})
    _write_json(tmp / "special_tokens_map.json", special)
    for f in hf.code_files():
        (tmp / f.name).write_text(hf.export_source(f))
    (tmp / "README.md").write_text(model_card(cfg, state, meta, model.num_parameters(), ck))
    hf.write_checksums(tmp)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def check_import_target(save_dir: Path, hf_dir, overwrite: bool) -> list:
    """The previous imports at ``save_dir`` that ``overwrite`` replaces; refuses a training run's directory
    (its checkpoints are never replaced by weights-only ones) and anything that is not an import."""
    check_not_input(save_dir, [hf_dir], "save_dir")
    if save_dir.exists() and not save_dir.is_dir():
        raise OutputError(f"save_dir '{save_dir}' is a file; give a directory for the imported checkpoint")
    if not is_nonempty_dir(save_dir):
        return []
    done = complete_checkpoints(checkpoints_root(save_dir)) if checkpoints_root(save_dir).is_dir() else []
    kinds = {ck: read_state(ck, verify=False) for ck in done}
    trained = [ck.name for ck, st in kinds.items() if st.get("kind") == "training"]
    if trained:
        raise OutputError(f"save_dir '{save_dir}' holds a training run ({', '.join(trained)}); an import would "
                          f"replace or mix with its checkpoints: choose a new save_dir for the import (then start "
                          f"training from it with train.init_from=<that directory>)")
    if not done or not all("imported_from" in st for st in kinds.values()):
        raise OutputError(f"save_dir '{save_dir}' is a non-empty directory that from-hf did not write; it is never "
                          f"replaced: choose a new save_dir")
    if not overwrite:
        raise OutputError(f"save_dir '{save_dir}' already holds an import ({', '.join(ck.name for ck in done)}): "
                          f"choose a new save_dir, or pass --overwrite to replace it")
    return done


def remove_imports(previous: list, keep: str) -> None:
    """Remove the previous imports :func:`check_import_target` validated (every one a weights-only import) but
    ``keep``, the step the new import publishes (replaced atomically by the publication)."""
    for ck in previous:
        if ck.name != keep:
            shutil.rmtree(ck)


def import_export(hf_dir: str | Path, save_dir: str | Path, step: int | None = None, overwrite: bool = False) -> Path:
    """An exported directory -> a weights-only native checkpoint under ``save_dir`` (returns its dir);
    ``overwrite`` replaces a previous import there (never a training run's checkpoints)."""
    save_dir = Path(save_dir)
    previous = check_import_target(save_dir, hf_dir, overwrite)
    model, _, tok, cfg = load_model(hf_dir)
    meta = json.loads((Path(hf_dir) / "config.json").read_text())
    step = int(meta.get("setdiff_mega_step", 0)) if step is None else step
    remove_imports(previous, keep=f"step_{step:07d}")
    return save_model_checkpoint(save_dir, step, model, cfg, tok, state={"imported_from": str(hf_dir)})


__all__ = ["export", "import_export", "check_import_target", "remove_imports", "TO_HF", "DTYPES"]
