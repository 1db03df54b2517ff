"""Llama 2 / 3 (``LlamaForCausalLM``) and Mistral without a sliding window (``MistralForCausalLM``).

Attention biases (``attention_bias``: q, k, v and o) and MLP biases (``mlp_bias``) as the config says; Llama 3
RoPE scaling; Llama 3's tokenizer has no MASK token, its first reserved special token is taken.
"""
from __future__ import annotations

from .base import Adapter, decoder_fields, decoder_hf_fields, refuse


def _biases(hf: dict) -> dict:
    attn, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    return {"add_bias_linear": attn, "mlp_bias": None if mlp == attn else mlp}


def llama_model(hf: dict, source: str, shapes: dict) -> dict:
    return {**decoder_fields(hf, source, "llama"), **_biases(hf)}


def mistral_model(hf: dict, source: str, shapes: dict) -> dict:
    window = hf.get("sliding_window")
    refuse(window is not None and window < int(hf.get("max_position_embeddings", 0)), source,
           f"sliding_window={window} (local attention) is not supported; only Mistral models without a sliding "
           f"window import")
    return {**decoder_fields(hf, source, "mistral"), **_biases(hf)}


def llama_hf(cfg) -> dict:
    mc = cfg.model
    return {**decoder_hf_fields(mc), "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "attention_bias": mc.add_bias_linear, "mlp_bias": mc.mlp_has_bias}


def mistral_hf(cfg) -> dict:
    mc = cfg.model
    return {**decoder_hf_fields(mc), "model_type": "mistral", "architectures": ["MistralForCausalLM"],
            "sliding_window": None}


LLAMA = Adapter("llama", ("llama",), ("LlamaForCausalLM",), llama_model, llama_hf,
                mask_tokens=("<|reserved_special_token_0|>",))
MISTRAL = Adapter("mistral", ("mistral",), ("MistralForCausalLM",), mistral_model, mistral_hf)
ADAPTERS = (LLAMA, MISTRAL)

__all__ = ["ADAPTERS", "LLAMA", "MISTRAL"]
