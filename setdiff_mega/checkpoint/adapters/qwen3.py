"""Qwen3 (``Qwen3ForCausalLM``; the backbone of the paper's GSM8K SetDLM): per-head RMSNorm on q and k before
RoPE (megatron-core's ``qk_layernorm``), ``head_dim`` independent of hidden / heads (128), attention biases
as ``attention_bias`` says, no sliding window; MASK is ``<|fim_middle|>`` (the reference's choice).

:data:`RELEASE`: setdlms' own Qwen3-backbone releases (``model_type`` bd3lm, the transformers model under
``backbone.model.``, e.g. ``kuleshov-group/setdlm-gsm8k-smax8``). Their ``config.json`` holds the
denoiser's config, not Qwen3's, so the architecture comes from the tensors' shapes (layers, hidden,
heads = q rows / head size, KV heads, head size = the q norm's width, MLP width, tied = no ``lm_head``)
and RoPE base / RMSNorm eps from ``backbone_config`` when it has them (Qwen3's 1e6 / 1e-6 otherwise); the
objective from the release's noise config (:func:`~.base.release_objective`).
"""
from __future__ import annotations

import dataclasses

from .base import Adapter, decoder_fields, decoder_hf_fields, refuse, release_objective
from .layout import DECODER_RULES


def qwen3_model(hf: dict, source: str, shapes: dict) -> dict:
    refuse(bool(hf.get("use_sliding_window")), source, "use_sliding_window=true (local attention) is not supported")
    return {**decoder_fields(hf, source, "qwen3"), "qk_layernorm": True,
            "add_bias_linear": bool(hf.get("attention_bias", False)),
            "mlp_bias": False if hf.get("attention_bias") else None}


def qwen3_hf(cfg) -> dict:
    mc = cfg.model
    return {**decoder_hf_fields(mc), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": mc.add_bias_linear, "use_sliding_window": False}


ADAPTER = Adapter("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), qwen3_model, qwen3_hf, mask_tokens=("<|fim_middle|>",))

RP = "backbone.model."
RELEASE_RULES = tuple(dataclasses.replace(r, hf=tuple(RP + h for h in r.hf)) for r in DECODER_RULES)


def release_model(raw: dict, source: str, shapes: dict) -> dict:
    c = raw.get("backbone_config") or {}
    layer = RP + "model.layers.0."
    hidden = shapes[RP + "model.embed_tokens.weight"][1]
    head = shapes[layer + "self_attn.q_norm.weight"][0]
    hf = {"hidden_size": hidden, "num_attention_heads": shapes[layer + "self_attn.q_proj.weight"][0] // head,
          "num_key_value_heads": shapes[layer + "self_attn.k_proj.weight"][0] // head, "head_dim": head,
          "intermediate_size": shapes[layer + "mlp.gate_proj.weight"][0],
          "num_hidden_layers": len({n.split(".")[4] for n in shapes if n.startswith(RP + "model.layers.")}),
          "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6)),
          "tie_word_embeddings": RP + "lm_head.weight" not in shapes,
          "rope_parameters": {"rope_type": "default", "rope_theta": float(c.get("rope_theta", 1e6))},
          "max_position_embeddings": int(raw.get("length", 4096))}
    return {**decoder_fields(hf, source, "qwen3"), "qk_layernorm": True}


RELEASE = Adapter("setdlm-qwen3", ("bd3lm",), ("BD3LM",), release_model, None, rules=RELEASE_RULES,
                  transformers_config=False, mask_tokens=("<|fim_middle|>",), objective=release_objective,
                  claims=lambda raw, names: RP + "model.embed_tokens.weight" in names,
                  ignore=(r".*rotary_emb\.inv_freq", r".*static_attention_mask", r".*sampling_eps_m(in|ax)"))
ADAPTERS = (ADAPTER, RELEASE)

__all__ = ["ADAPTERS", "ADAPTER", "RELEASE"]
