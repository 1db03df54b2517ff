"""Conversions between a native checkpoint and the Hugging Face format of :mod:`.hf`:
``export`` (native -> ``config.json`` + ``generation_config.json`` (the decoding defaults) +
``model.safetensors`` (fp32, bit-exact, or bf16) + tokenizer + the standalone code + a model card
``README.md``; atomic: written to ``<out>.tmp`` and renamed) and ``import_export`` (an export -> a
weights-only native checkpoint). Kept apart from the format so that loading (``native.load_model``,
which reads exports) and converting (which loads models) do not import each other.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from setdiff_mega import methods
from setdiff_mega.standalone.base import GenerationConfig
from setdiff_mega.standalone.generation_setdlm import GENERATION_FILE

from . import hf
from .card import model_card
from .io import CheckpointError, resolve_checkpoint
from .native import load_model, save_model_checkpoint

DTYPES = {"fp32": ("float32", torch.float32), "bf16": ("bfloat16", torch.bfloat16)}


def export(checkpoint: str | Path, out_dir: str | Path, weights: str | None = None, dtype: str = "fp32") -> Path:
    """Write the Hugging Face directory of a native checkpoint; ``weights``: ema | raw | None (the EMA when
    the checkpoint has one); ``dtype``: fp32 (bit-exact) | bf16."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise CheckpointError(f"export dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    ck, state = resolve_checkpoint(checkpoint)
    model, _, tok, cfg = load_model(ck, weights=weights)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    name, torch_dtype = DTYPES[dtype]
    tensors = {k: v.to(torch_dtype).contiguous() for k, v in hf.native_to_hf(model.state_dict(), cfg.model).items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "producer": "setdiff-mega"})
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
        shutil.copyfile(f, tmp / f.name)
    (tmp / "README.md").write_text(model_card(cfg, state, meta, model.num_parameters(), ck))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def import_export(hf_dir: str | Path, save_dir: str | Path, step: int | None = None) -> Path:
    """An exported directory -> a weights-only native checkpoint under ``save_dir`` (returns its dir)."""
    model, _, tok, cfg = load_model(hf_dir)
    meta = json.loads((Path(hf_dir) / "config.json").read_text())
    step = int(meta.get("setdiff_mega_step", 0)) if step is None else step
    return save_model_checkpoint(save_dir, step, model, cfg, tok, state={"imported_from": str(hf_dir)})


__all__ = ["export", "import_export"]
