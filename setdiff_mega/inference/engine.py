"""Which model the samplers decode with: the engine.

    native   the megatron-core model itself (any TP / PP layout the process was built with)
    plain    the inference format's plain-PyTorch model (:mod:`setdiff_mega.hfmodel.modeling_setdlm`, the
             code every Hugging Face export carries), built in memory from the same weights by the export's
             name mapping (:data:`setdiff_mega.checkpoint.hf.RULES`) and wrapped in
             :class:`~setdiff_mega.hfmodel.generation_setdlm.DecodeModel`; same function, same samplers,
             identical greedy tokens (tests/inference/test_export_generate.py), none of megatron-core's
             per-layer overhead
    auto     plain for an unsharded model (TP = PP = 1), else native

``tools/generate.py``, ``tools/evaluate.py`` (its decoding tasks; likelihoods stay on the native model)
and the lm-eval adapter take ``--engine`` / ``engine=``.
"""
from __future__ import annotations

import torch

from setdiff_mega.checkpoint import hf
from setdiff_mega.hfmodel.configuration_setdlm import SetDLMConfig
from setdiff_mega.hfmodel.generation_setdlm import DecodeModel
from setdiff_mega.hfmodel.modeling_setdlm import SetDLMForDiffusionLM

ENGINES = ("auto", "plain", "native")


def _unsharded(model) -> bool:
    c = getattr(model, "config", None)
    return (getattr(c, "tensor_model_parallel_size", 1) == 1 and getattr(c, "pipeline_model_parallel_size", 1) == 1
            and getattr(model, "pre_process", True) and getattr(model, "post_process", True))


def plain_model(model, cfg, tokenizer):
    """The plain-PyTorch twin of a single-process native model, ready for the samplers."""
    p = next(model.parameters())
    conf = SetDLMConfig(**hf.hf_config(cfg, tokenizer, model.padded_vocab_size))
    twin = SetDLMForDiffusionLM(conf)
    twin.load_state_dict(hf.native_to_hf(model.state_dict(), cfg.model))
    dm = DecodeModel(twin.to(device=p.device, dtype=p.dtype).eval(), cfg.data.seq_length)
    for attr in ("tokenizer_hash", "weights_kind"):
        if hasattr(model, attr):
            setattr(dm, attr, getattr(model, attr))
    return dm


def decoding_model(model, cfg, tokenizer, engine: str = "auto"):
    """``model`` itself (native) or its plain twin (see the module docstring)."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is unknown; choose one of {', '.join(ENGINES)}")
    if engine == "native" or (engine == "auto" and not _unsharded(model)):
        return model
    if not _unsharded(model):
        raise ValueError("engine 'plain' decodes unsharded models only (TP = PP = 1); use --engine native")
    with torch.no_grad():
        return plain_model(model, cfg, tokenizer)


__all__ = ["ENGINES", "decoding_model", "plain_model"]
