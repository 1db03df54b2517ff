"""Plain-PyTorch modelling code of an exported setdiff-mega model, for ``trust_remote_code=True``.

It needs torch and transformers only (no megatron-core) and computes the same function as the training
model (``setdiff_mega.model.SetDiffusionTransformer``):

    h = embed_tokens[input_ids]                                          [B, T, H]
    for each layer:  h = h + o_proj(attn(norm1(h)));  h = h + mlp(norm2(h))
    logits = lm_head(norm(h))[:, logits_start:, :tokenizer_vocab_size]  [B, T - s, V]

Attention is pre-norm multi-head (grouped-query when ``num_key_value_heads`` < heads; ``head_dim``
channels per head) with rotary embeddings at the given ``position_ids`` (rotate-half layout on the first
``rotary_percent`` of each head, as megatron-core; Llama 3 frequency scaling by ``rotary_scaling``), an
optional per-head norm of q and k before the rotation (``qk_norm``), scaled dot-product, no dropout at
inference. The MLP is GELU (erf or tanh; up, down) or SwiGLU (silu(gate) * up, down). Biases: q / k / v
(``qkv_bias``), o (``attention_bias``), the MLP (``mlp_bias``), LayerNorm (``norm_bias``).

``attention_mask`` may be a boolean ``[B, T, T]`` or ``[B, 1, T, T]`` matrix (True = may attend; the
set-causal, block or causal masks the diffusion objectives use) or a ``[B, T]`` padding mask (1 = real
token), combined with the method's default pattern: causal for an AR model, bidirectional otherwise.
``position_ids`` default to 0..T-1. SetDLM's 2L training layout is reproduced by passing its tokens,
positions and mask. ``config.method`` says how the model was trained and how to decode it.

Decoding: ``model.generate(input_ids, attention_mask=None, max_new_tokens=..., window=..., tau=...)`` and
``model.infill(prefix_ids, suffix_ids, span)`` run the checkpoint's sampler with a KV cache
(:mod:`.generation_setdlm`; each decode forward is :mod:`.decode_step`, the same function over fused
weights). ``from_pretrained`` checks the directory first (every file against ``SHA256SUMS``, :mod:`.integrity`;
``verify_checksums=False`` skips that; weights present and shaped as the config says, a tokenizer with the
MASK token) and reads ``generation_config.json``.
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput
from transformers.utils import cached_file

from .configuration_setdlm import SetDLMConfig
from .cpu_kernels import SOURCE_NAME, use_source
from .decode_step import inverse_frequencies, rope_cos_sin, rotate
from .generation_setdlm import generate as _generate
from .generation_setdlm import infill as _infill
from .generation_setdlm import read_defaults
from .integrity import verify_checksums


def _norm(config: SetDLMConfig, width: int | None = None) -> nn.Module:
    width = width or config.hidden_size
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(width, eps=config.norm_eps)
    return nn.LayerNorm(width, eps=config.norm_eps, bias=getattr(config, "norm_bias", True))


class SetDLMRotary(nn.Module):
    """Angles computed on the fly (no buffer: transformers materialises modules from the meta device, and
    a non-persistent buffer would come back uninitialised)."""

    def __init__(self, config: SetDLMConfig):
        super().__init__()
        self.dim = int(config.head_dim * config.rotary_percent)
        self.base = float(config.rope_theta)
        self.scaling = config.rotary_scaling

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple:
        """[B, T] -> (cos, sin) [B, 1, T, rot_dim] in ``dtype``, computed once per forward and shared by
        every layer (the same functions as the decode step)."""
        return rope_cos_sin(position_ids, inverse_frequencies(self.dim, self.base, self.scaling), dtype)

    @staticmethod
    def apply(x: torch.Tensor, rope: tuple) -> torch.Tensor:
        return rotate(x, *rope)


class SetDLMAttention(nn.Module):
    def __init__(self, config: SetDLMConfig):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        h, qkv_bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm, self.k_norm = _norm(config, self.head_dim), _norm(config, self.head_dim)

    def forward(self, x, rope, keep):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = SetDLMRotary.apply(q, rope), SetDLMRotary.apply(k, rope)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class SetDLMMLP(nn.Module):
    def __init__(self, config: SetDLMConfig):
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gated = config.hidden_act == "swiglu"
        self.approximate = "tanh" if config.hidden_act == "gelu_tanh" else "none"
        if self.gated:
            self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))


class SetDLMLayer(nn.Module):
    def __init__(self, config: SetDLMConfig):
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = SetDLMAttention(config)
        self.post_attention_layernorm = _norm(config)
        self.mlp = SetDLMMLP(config)

    def forward(self, x, rope, keep):
        x = x + self.self_attn(self.input_layernorm(x), rope, keep)
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
        if method and "causal" not in method:
            raise ValueError("config.json 'method' lacks the 'causal' flag (an export older than the flag): re-export "
                             "the checkpoint with tools/convert_checkpoint.py to-hf")
        causal = method.get("causal", True)      # a bare config (no method): causal, like SetDLMConfig's default
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
        rope = self.rotary(position_ids, self.embed_tokens.weight.dtype)
        keep = self._keep_mask(attention_mask, b, t, input_ids.device)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, rope, keep)
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
        v = self.config.tokenizer_vocab_size            # the padded rows' logits are never computed
        if self.lm_head_tied:
            bias = getattr(self, "lm_head_bias", None)
            logits = F.linear(h, self.model.embed_tokens.weight[:v], None if bias is None else bias[:v])
        else:
            bias = self.lm_head.bias
            logits = F.linear(h, self.lm_head.weight[:v], None if bias is None else bias[:v])
        return CausalLMOutput(logits=logits) if return_dict else (logits,)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        config = kwargs.get("config")
        verify = kwargs.pop("verify_checksums", True)
        if not isinstance(config, SetDLMConfig):
            config = SetDLMConfig.from_pretrained(pretrained_model_name_or_path)
        check_export(pretrained_model_name_or_path, config, cls, verify)
        use_source(_fetch(pretrained_model_name_or_path, SOURCE_NAME))   # the kernels' source: not copied with us
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model.decode_defaults = read_defaults(pretrained_model_name_or_path)
        return model

    def generate(self, input_ids, attention_mask=None, **kwargs):
        """Decode with the checkpoint's sampler and a KV cache (options: :mod:`.generation_setdlm`)."""
        return _generate(self, input_ids, attention_mask, **kwargs)

    def infill(self, prefix_ids, suffix_ids, span: int, **kwargs):
        """Fill ``span`` positions between ``prefix_ids`` and ``suffix_ids``."""
        return _infill(self, prefix_ids, suffix_ids, span, **kwargs)


def _fail(path, what: str):
    raise ValueError(f"SetDLM export '{path}': {what}; re-export it with tools/convert_checkpoint.py to-hf")


def _fetch(path, name: str):
    """The local path of an export's file ``name`` (None when it is absent)."""
    try:
        return cached_file(str(path), name, _raise_exceptions_for_missing_entries=False)
    except OSError:
        return None


def check_export(path, config: SetDLMConfig, cls, verify: bool = True) -> None:
    """One clear error for a bad export: files that do not match their checksums, missing or unreadable
    weights, tensors that do not fit the config, a method without a sampler, a tokenizer without the MASK
    token."""
    def fetch(name):
        return _fetch(path, name)
    m = config.method or {}
    if "mask_token_id" not in m or "sampler" not in m:
        _fail(path, "config.json 'method' lacks mask_token_id / sampler (exported before generate() existed)")
    weights = fetch("model.safetensors")
    if weights is None:
        _fail(path, "model.safetensors is missing")
    try:
        with safe_open(weights, "pt") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        _fail(path, f"model.safetensors is truncated or unreadable ({e})")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    bad = [f"{k}: file {found.get(k)}, config {v}" for k, v in expected.items() if found.get(k) != v]
    bad += [f"{k}: not used by the config" for k in found if k not in expected]
    if bad:
        _fail(path, f"the weights do not match config.json ({'; '.join(bad[:3])})")
    problem = verify_checksums(fetch) if verify else None     # a corruption that still parses (a flipped bit)
    if problem:
        raise ValueError(f"SetDLM export '{path}': {problem}")
    tok_file = fetch("tokenizer.json")
    if tok_file is None:
        raise ValueError(f"SetDLM export '{path}': tokenizer.json is missing (every export carries the tokenizer "
                         f"its model was trained with): the copy is incomplete; copy the whole directory again")
    added = {t["id"]: t["content"] for t in json.loads(open(tok_file, encoding="utf-8").read()).get("added_tokens", [])}
    if m["mask_token_id"] not in added:
        _fail(path, f"tokenizer.json has no MASK token with id {m['mask_token_id']} (the config's mask_token_id)")


__all__ = ["SetDLMModel", "SetDLMForDiffusionLM", "SetDLMPreTrainedModel", "check_export"]
