"""Which model the samplers decode with: the engine.

    plain    the inference format's plain-PyTorch model (:mod:`setdiff_mega.hfmodel.modeling_setdlm`, the
             code every Hugging Face export carries), built in memory from the same weights by the export's
             name mapping (:data:`setdiff_mega.checkpoint.hf.RULES`) and wrapped in
             :class:`~setdiff_mega.hfmodel.generation_setdlm.DecodeModel`: one fused forward per step
             (:mod:`setdiff_mega.hfmodel.decode_step`) whose products read the weights in the
             ``decode_weights`` format (fp32 | fp32-packed | bf16 | int8, :mod:`setdiff_mega.hfmodel.linears`);
             same function and samplers as the native model, identical greedy tokens in fp32
             (tests/inference/test_export_generate.py)
    native   the megatron-core model itself: used for decoding only when the process holds a sharded model
             (TP or PP > 1), where no plain twin exists. An unsharded model decodes through the plain
             forward whichever engine is named (one fast path: megatron-core's per-layer modules cost
             more per step, docs/results.md "Decode near the bandwidth floor")
    auto     the same as native: plain when unsharded, else the megatron-core model

``tools/generate.py``, ``tools/evaluate.py`` (its decoding tasks; likelihoods stay on the native model),
``tools/serve.py`` and the lm-eval adapter take ``--engine`` / ``engine=`` and ``--decode-weights``. The decode
weights default to ``auto``, resolved here against the model's device by :func:`setdiff_mega.hfmodel.linears.resolve`
(fp32-packed on a CPU, fp32 on a GPU; a sharded model decodes in fp32); :func:`weights_format` says which one a
decoding model uses. ``fp32`` named explicitly is the megatron-core-exact path.
"""
from __future__ import annotations

import torch

from setdiff_mega.checkpoint import hf
from setdiff_mega.hfmodel.configuration_setdlm import SetDLMConfig
from setdiff_mega.hfmodel.generation_setdlm import DecodeModel
from setdiff_mega.hfmodel.linears import AUTO, check_choice, resolve
from setdiff_mega.hfmodel.modeling_setdlm import SetDLMForDiffusionLM

ENGINES = ("auto", "plain", "native")


def _unsharded(model) -> bool:
    c = getattr(model, "config", None)
    return (getattr(c, "tensor_model_parallel_size", 1) == 1 and getattr(c, "pipeline_model_parallel_size", 1) == 1
            and getattr(model, "pre_process", True) and getattr(model, "post_process", True))


def plain_model(model, cfg, tokenizer, decode_weights: str = "fp32"):
    """The plain-PyTorch twin of a single-process native model, ready for the samplers."""
    p = next(model.parameters())
    conf = SetDLMConfig(**hf.hf_config(cfg, tokenizer, model.padded_vocab_size))
    twin = SetDLMForDiffusionLM(conf)
    twin.load_state_dict(hf.native_to_hf(model.state_dict(), cfg.model))
    dm = DecodeModel(twin.to(device=p.device, dtype=p.dtype).eval(), cfg.data.seq_length, decode_weights)
    for attr in ("tokenizer_hash", "weights_kind"):
        if hasattr(model, attr):
            setattr(dm, attr, getattr(model, attr))
    return dm


def decoding_model(model, cfg, tokenizer, engine: str = "auto", decode_weights: str = AUTO):
    """The plain twin of an unsharded model, or a sharded model itself (see the module docstring); ``auto``
    decode weights are resolved against the model's device."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is unknown; choose one of {', '.join(ENGINES)}")
    check_choice(decode_weights)
    if not _unsharded(model):
        if engine == "plain":
            raise ValueError("engine 'plain' decodes unsharded models only (TP = PP = 1); use --engine native")
        if decode_weights not in ("fp32", AUTO):
            raise ValueError(f"--decode-weights {decode_weights} needs the plain engine (an unsharded model, "
                             "TP = PP = 1); a sharded model decodes in fp32")
        return model
    p = next(model.parameters())
    with torch.no_grad():
        return plain_model(model, cfg, tokenizer, resolve(decode_weights, p.device, p.dtype))


def weights_format(model) -> str:
    """The decode-weights format a :func:`decoding_model` result decodes in (a sharded model: fp32)."""
    return getattr(model, "decode_weights", "fp32")


__all__ = ["ENGINES", "decoding_model", "plain_model", "weights_format"]
