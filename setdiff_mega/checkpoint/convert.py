"""Conversions between a native checkpoint and the Hugging Face format of :mod:`.hf`:
``export`` (native -> ``config.json`` + ``model.safetensors`` + tokenizer + modelling code; fp32,
bit-exact, atomic: written to ``<out>.tmp`` and renamed) and ``import_export`` (an export -> a
weights-only native checkpoint). Kept apart from the format so that loading (``native.load_model``,
which reads exports) and converting (which loads models) do not import each other.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import hf
from .io import resolve_checkpoint
from .native import load_model, save_model_checkpoint


def export(checkpoint: str | Path, out_dir: str | Path, weights: str | None = None) -> Path:
    """Write the Hugging Face directory of a native checkpoint (weights in fp32, bit-exact); ``weights``:
    ema | raw | None (the EMA when the checkpoint has one)."""
    from safetensors.torch import save_file


    ck, state = resolve_checkpoint(checkpoint)
    model, _, tok, cfg = load_model(ck, weights=weights)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = hf.native_to_hf(model.state_dict(), cfg.model)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "producer": "setdiff-mega"})
    meta = {**hf.hf_config(cfg, tok, model.padded_vocab_size), "setdiff_mega_step": int(state.get("step", 0)),
            "setdiff_mega_weights": model.weights_kind}
    (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    tok.save(tmp / "tokenizer.json")
    special = {"bos_token": tok.token(tok.bos), "eos_token": tok.token(tok.eos), "pad_token": tok.token(tok.pad),
               "mask_token": tok.token(tok.mask)}
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.model.max_position_embeddings,
         **special}, indent=2))
    (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    code = Path(__file__).resolve().parent.parent / "hf"
    for f in hf.CODE_FILES:
        shutil.copyfile(code / f, tmp / f)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def import_export(hf_dir: str | Path, save_dir: str | Path, step: int | None = None) -> Path:
    """An exported directory -> a weights-only native checkpoint under ``save_dir`` (returns its dir)."""
    model, _, tok, cfg = load_model(hf_dir)
    meta = json.loads((Path(hf_dir) / "config.json").read_text())
    step = int(meta.get("setdiff_mega_step", 0)) if step is None else step
    return save_model_checkpoint(save_dir, step, model, cfg, tok, state={"imported_from": str(hf_dir)})


__all__ = ["export", "import_export"]
