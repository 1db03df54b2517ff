"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): biases on q, k and v only, no sliding window; MASK is
``<|fim_middle|>`` when the tokenizer has it (as the reference does for Qwen)."""
from __future__ import annotations

from .base import Adapter, decoder_fields, decoder_hf_fields, refuse


def qwen2_model(hf: dict, source: str, shapes: dict) -> dict:
    refuse(bool(hf.get("use_sliding_window")), source, "use_sliding_window=true (local attention) is not supported")
    return {**decoder_fields(hf, source, "qwen2"), "add_qkv_bias": True}


def qwen2_hf(cfg) -> dict:
    mc = cfg.model
    return {**decoder_hf_fields(mc), "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
            "use_sliding_window": False}


ADAPTER = Adapter("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), qwen2_model, qwen2_hf, mask_tokens=("<|fim_middle|>",))
ADAPTERS = (ADAPTER,)

__all__ = ["ADAPTERS", "ADAPTER"]
