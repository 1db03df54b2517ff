"""The composition root: a RunConfig becomes its tokenizer, vocabulary, objective and model here, and only
here. Training (``training/trainer.py``), checkpoint loading (``checkpoint/native.py: load_model``), the
evaluation and the tools all call these functions, so every path applies the same checks.

    tokenizer_path(cfg)           data.tokenizer, or tokenizer.json next to the (first) dataset
    tokenizer_for(cfg)            that tokenizer, loaded
    vocab_for(cfg, tok)           model.vocab_size or the tokenizer's; must hold every special id
    objective_for(cfg, tok)       the objective of ``cfg.objective`` with the tokenizer's MASK / EOS ids
    model_for(cfg, vocab, ...)    this rank's part of the model (megatron-core parallel state must be set)

Layering (checked by ``tests/unit/test_layering.py``): this module sits above ``config``, ``data``,
``diffusion`` and ``model`` and below ``checkpoint``, ``training``, ``inference``, ``eval`` and ``cli``.
"""
from __future__ import annotations

from pathlib import Path

from setdiff_mega.config import ConfigError, RunConfig
from setdiff_mega.data.blend import parse_blend
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.diffusion import build_objective
from setdiff_mega.errors import DataError
from setdiff_mega.model import build_model


def tokenizer_path(cfg: RunConfig) -> str:
    """data.tokenizer, or tokenizer.json next to the (first) dataset of the blend."""
    return cfg.data.tokenizer or str(Path(parse_blend(cfg.data.path)[0][0]).parent / "tokenizer.json")


def tokenizer_for(cfg: RunConfig) -> Tokenizer:
    path = tokenizer_path(cfg)
    try:
        return Tokenizer.from_file(path)
    except FileNotFoundError as e:
        raise DataError(f"{e} (data.tokenizer)") from None


def vocab_for(cfg: RunConfig, tok: Tokenizer) -> int:
    vocab = cfg.model.vocab_size or tok.vocab_size
    top = max(tok.special_ids.values())
    if vocab <= top:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's special ids (up to {top}, "
                          f"vocabulary {tok.vocab_size}); remove the override or set it >= {tok.vocab_size}")
    return vocab


def objective_for(cfg: RunConfig, tok: Tokenizer):
    """The objective of ``cfg.objective`` (its method's options) with the tokenizer's MASK / EOS ids."""
    return build_objective(cfg.objective.name, tok.mask, eos_id=tok.eos, options=cfg.objective.options,
                           dense_masks=cfg.parallel.context_parallel_size == 1, shift_logits=cfg.model.shift_logits)


def model_for(cfg: RunConfig, vocab: int, *, sequence_parallel: bool = False):
    return build_model(cfg.model, vocab, sequence_parallel=sequence_parallel)


__all__ = ["tokenizer_path", "tokenizer_for", "vocab_for", "objective_for", "model_for"]
