"""Qwen3 (``Qwen3ForCausalLM``; the backbone of the paper's GSM8K SetDLM and of setdlms' Qwen3 releases):
per-head RMSNorm on q and k before RoPE (megatron-core's ``qk_layernorm``), ``head_dim`` independent of
hidden / heads (128), attention biases as ``attention_bias`` says, no sliding window; MASK is
``<|fim_middle|>`` (the reference's choice)."""
from __future__ import annotations

from .base import Adapter, decoder_fields, decoder_hf_fields, refuse


def qwen3_model(hf: dict, source: str) -> dict:
    refuse(bool(hf.get("use_sliding_window")), source, "use_sliding_window=true (local attention) is not supported")
    return {**decoder_fields(hf, source, "qwen3"), "qk_layernorm": True,
            "add_bias_linear": bool(hf.get("attention_bias", False)),
            "mlp_bias": False if hf.get("attention_bias") else None}


def qwen3_hf(mc) -> dict:
    return {**decoder_hf_fields(mc), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": mc.add_bias_linear, "use_sliding_window": False}


ADAPTER = Adapter("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), qwen3_model, qwen3_hf, mask_tokens=("<|fim_middle|>",))
ADAPTERS = (ADAPTER,)

__all__ = ["ADAPTERS", "ADAPTER"]
