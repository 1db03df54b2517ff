"""Plain-PyTorch modelling code of an exported setdiff-mega model, for ``trust_remote_code=True``.

It needs torch and transformers only (no megatron-core) and computes the same function as the training
model (``setdiff_mega.model.SetDiffusionTransformer``):

    h = embed_tokens[input_ids]                                          [B, T, H]
    for each layer:  h = h + o_proj(attn(norm1(h)));  h = h + mlp(norm2(h))
    logits = lm_head(norm(h))[:, logits_start:, :tokenizer_vocab_size]  [B, T - s, V]

Attention is pre-norm multi-head (grouped-query when ``num_key_value_heads`` < heads) with rotary
embeddings at the given ``position_ids`` (rotate-half layout on the first ``rotary_percent`` of each head,
as megatron-core), scaled dot-product, no dropout at inference. The MLP is GELU (up, down) or SwiGLU
(silu(gate) * up, down).

``attention_mask`` may be a boolean ``[B, T, T]`` or ``[B, 1, T, T]`` matrix (True = may attend; the
set-causal, block or causal masks the diffusion objectives use) or a ``[B, T]`` padding mask (1 = real
token), combined with the method's default pattern: causal for an AR model, bidirectional otherwise.
``position_ids`` default to 0..T-1. SetDLM's 2L training layout is reproduced by passing its tokens,
positions and mask. ``config.method`` says how the model was trained and how to decode it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_setdlm import SetDLMConfig

CAUSAL_OBJECTIVES = ("ar",)     # objectives decoded left to right (config.json "method" of old exports)


def _norm(config: SetDLMConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class SetDLMRotary(nn.Module):
    """Angles computed on the fly (no buffer: transformers materialises modules from the meta device, and
    a non-persistent buffer would come back uninitialised)."""

    def __init__(self, config: SetDLMConfig):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        self.dim = int(head_dim * config.rotary_percent)
        self.base = float(config.rope_theta)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> angles [B, 1, T, rot_dim] (frequencies repeated over the two halves)."""
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=position_ids.device) / self.dim
        inv_freq = 1.0 / (self.base ** exponent)
        freqs = position_ids.to(torch.float32)[..., None] * inv_freq
        return torch.cat((freqs, freqs), dim=-1)[:, None]

    @staticmethod
    def apply(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        rot = angles.shape[-1]
        x, passthrough = x[..., :rot], x[..., rot:]
        x = x * torch.cos(angles).to(x.dtype) + _rotate_half(x) * torch.sin(angles).to(x.dtype)
        return torch.cat((x, passthrough), dim=-1)


class SetDLMAttention(nn.Module):
    def __init__(self, config: SetDLMConfig):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x, angles, keep):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = SetDLMRotary.apply(q, angles), SetDLMRotary.apply(k, angles)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class SetDLMMLP(nn.Module):
    def __init__(self, config: SetDLMConfig):
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.attention_bias
        self.gated = config.hidden_act == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class SetDLMLayer(nn.Module):
    def __init__(self, config: SetDLMConfig):
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = SetDLMAttention(config)
        self.post_attention_layernorm = _norm(config)
        self.mlp = SetDLMMLP(config)

    def forward(self, x, angles, keep):
        x = x + self.self_attn(self.input_layernorm(x), angles, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class SetDLMPreTrainedModel(PreTrainedModel):
    config_class = SetDLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["SetDLMLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = 0.02
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)


class SetDLMModel(SetDLMPreTrainedModel):
    """The transformer body: final-norm hidden states [B, T, H]."""

    def __init__(self, config: SetDLMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SetDLMLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = _norm(config)
        self.rotary = SetDLMRotary(config)
        self.post_init()

    def _keep_mask(self, attention_mask, b, t, device):
        """-> boolean [B, 1, T, T], True = may attend."""
        method = self.config.method
        causal = method.get("causal", method.get("objective", "ar") in CAUSAL_OBJECTIVES)   # exports before the flag
        base = (torch.ones(t, t, dtype=torch.bool, device=device).tril() if causal
                else torch.ones(t, t, dtype=torch.bool, device=device))
        if attention_mask is None:
            return base[None, None].expand(b, 1, t, t)
        m = attention_mask.to(device)
        if m.dim() == 2:                      # padding mask: keys that are real tokens
            return base[None, None] & m.bool()[:, None, None, :]
        if m.dim() == 3:
            m = m[:, None]
        return m.bool()

    def forward(self, input_ids, position_ids=None, attention_mask=None, **kwargs):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        angles = self.rotary(position_ids)
        keep = self._keep_mask(attention_mask, b, t, input_ids.device)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, angles, keep)
        return self.norm(h)


class SetDLMForDiffusionLM(SetDLMPreTrainedModel):
    """Body + LM head: ``logits`` [B, T - logits_start, tokenizer_vocab_size]."""

    def __init__(self, config: SetDLMConfig):
        super().__init__(config)
        self.model = SetDLMModel(config)
        self.lm_head_tied = bool(config.tie_word_embeddings)
        if not self.lm_head_tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.head_bias)
        elif config.head_bias:
            self.lm_head_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.post_init()

    def forward(self, input_ids, position_ids=None, attention_mask=None, logits_start: int = 0,
                return_dict: bool = True, **kwargs):
        h = self.model(input_ids, position_ids=position_ids, attention_mask=attention_mask)[:, logits_start:]
        if self.lm_head_tied:
            logits = F.linear(h, self.model.embed_tokens.weight, getattr(self, "lm_head_bias", None))
        else:
            logits = self.lm_head(h)
        logits = logits[..., : self.config.tokenizer_vocab_size]
        return CausalLMOutput(logits=logits) if return_dict else (logits,)


__all__ = ["SetDLMModel", "SetDLMForDiffusionLM", "SetDLMPreTrainedModel"]
