"""The model section: the transformer's shape and its architecture variants (the features of the Llama,
Qwen2 / Qwen3 and reference-DiT families), its implementation and kernels, and its checks.

Shapes: heads h, KV groups G (GQA), head size d = ``kv_channels`` (or hidden / h); q / k / v project
hidden -> h * d, G * d, G * d. RoPE rotates the first ``rotary_percent`` of each head's d channels with
inverse frequencies base^(-2i / d_rot), optionally rescaled by Llama 3's rule (``rope_scaling=llama3``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from setdiff_mega import backends

from .errors import ConfigError


@dataclass
class ModelConfig:
    family: Optional[str] = None                 # the Hugging Face family it was imported from (llama, qwen3, ...)
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None       # GQA; None = num_attention_heads (see query_groups)
    ffn_hidden_size: Optional[int] = None        # None = 4 * hidden_size
    vocab_size: Optional[int] = None             # None = from the tokenizer
    make_vocab_size_divisible_by: int = 128      # embedding/head padding (sliced off in the logits)
    max_position_embeddings: int = 4096          # initial RoPE table; grows on demand at inference
    kv_channels: Optional[int] = None            # head size; None = hidden_size / num_attention_heads (Qwen3: 128)
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: Optional[str] = None           # None | llama3 (Llama 3.1+ frequency scaling, the four fields below)
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    normalization: str = "LayerNorm"             # LayerNorm | RMSNorm
    norm_eps: float = 1e-5
    norm_bias: bool = True                       # LayerNorm's bias (the reference's DiT has none; RMSNorm has none)
    qk_layernorm: bool = False                   # a per-head norm (model.normalization) on q and k before RoPE (Qwen3)
    activation: str = "gelu"                     # gelu (erf) | gelu_tanh | swiglu
    add_bias_linear: bool = False                # a bias on every linear layer of the body
    add_qkv_bias: bool = False                   # a bias on q / k / v only (Qwen2)
    mlp_bias: Optional[bool] = None              # the MLP's biases; None = add_bias_linear (DiT: true)
    head_bias: bool = True                       # DiT head: untied, with bias, zero-initialised
    zero_init_head: bool = True
    tie_embeddings: bool = False
    shift_logits: bool = False                   # the AR shift: a target reads its predecessor's row (method.md 13);
                                                 # False = the reference (the row of the target's own position)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    attention_backend: str = "sdpa"              # sdpa (dense mask) | flex | setcausal (mask-free) | local
    transformer_impl: str = "auto"               # auto | local | transformer_engine
    fp8: str = "none"                            # none | te (Transformer Engine) | torchao (float8 linears, TP=1)
    fp8_recipe: str = "tensorwise"               # tensorwise (current scaling) | delayed (te) | rowwise (torchao)
    recompute_granularity: Optional[str] = None  # activation recomputation (megatron-core): None | selective (core
                                                 # attention) | full (whole layers, with recompute_method)
    recompute_method: Optional[str] = None       # full: uniform (every recompute_num_layers layers one unit) |
                                                 # block (the first recompute_num_layers layers of each stage)
    recompute_num_layers: Optional[int] = None

    @property
    def query_groups(self) -> int:
        """KV heads (GQA groups); num_attention_heads when not set."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """Channels per attention head (``kv_channels``, or hidden size / heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def mlp_has_bias(self) -> bool:
        return self.add_bias_linear if self.mlp_bias is None else self.mlp_bias

    @property
    def qkv_has_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    def rope_scaling_parameters(self) -> Optional[dict]:
        """The RoPE scaling in Hugging Face's terms (``rope_type`` and its parameters), or None."""
        if self.rope_scaling is None:
            return None
        return {"rope_type": self.rope_scaling, "factor": self.rope_scaling_factor,
                "low_freq_factor": self.rope_low_freq_factor, "high_freq_factor": self.rope_high_freq_factor,
                "original_max_position_embeddings": self.rope_original_max_positions}

    def _check_recompute(self) -> None:
        g, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if g is None:
            if method is not None or n is not None:
                raise ConfigError("model.recompute_method / recompute_num_layers need model.recompute_granularity=full")
            return
        _choice(g, ("selective", "full"), "model.recompute_granularity")
        if g == "selective":
            if method is not None or n is not None:
                raise ConfigError("model.recompute_granularity=selective recomputes the core attention of every "
                                  "layer: remove model.recompute_method and model.recompute_num_layers")
            return
        if method is None:
            raise ConfigError("model.recompute_granularity=full needs model.recompute_method=uniform|block")
        _choice(method, ("uniform", "block"), "model.recompute_method")
        if n is None or not 1 <= n <= self.num_layers:
            raise ConfigError(f"model.recompute_granularity=full needs model.recompute_num_layers between 1 and "
                              f"model.num_layers={self.num_layers} (got {n})")

    def check(self, tensor_parallel: int = 1) -> None:
        """This section's own checks (ConfigError naming the field and the fix)."""
        _choice(self.normalization, ("LayerNorm", "RMSNorm"), "model.normalization")
        _choice(self.activation, ("gelu", "gelu_tanh", "swiglu"), "model.activation")
        _choice(self.attention_backend, backends.names(), "model.attention_backend")
        _choice(self.transformer_impl, ("auto", "local", "transformer_engine"), "model.transformer_impl")
        _choice(self.fp8, ("none", "te", "torchao"), "model.fp8")
        _choice(self.fp8_recipe, ("tensorwise", "delayed", "rowwise"), "model.fp8_recipe")
        if self.fp8 == "te" and self.transformer_impl == "local":
            raise ConfigError("model.fp8=te needs Transformer Engine: set model.transformer_impl=transformer_engine "
                              "(or auto), or use model.fp8=torchao with the local implementation")
        if self.fp8 == "te" and self.fp8_recipe == "rowwise":
            raise ConfigError("model.fp8_recipe=rowwise is torchao's; with model.fp8=te use tensorwise or delayed")
        if self.fp8 == "torchao" and self.fp8_recipe == "delayed":
            raise ConfigError("model.fp8_recipe=delayed is Transformer Engine's; with model.fp8=torchao use "
                              "tensorwise or rowwise")
        if self.fp8 == "torchao" and tensor_parallel > 1:
            raise ConfigError("model.fp8=torchao runs with parallel.tensor_model_parallel_size=1 only; use "
                              "model.fp8=te (Transformer Engine) for tensor parallelism")
        _at_least_one(("model.num_layers", self.num_layers), ("model.hidden_size", self.hidden_size),
                      ("model.num_attention_heads", self.num_attention_heads))
        self._check_recompute()
        self._check_heads()
        self._check_rope()
        if self.norm_eps <= 0:
            raise ConfigError(f"model.norm_eps={self.norm_eps} must be > 0")
        if self.vocab_size is not None and self.vocab_size < 4:
            raise ConfigError(f"model.vocab_size={self.vocab_size} is too small (needs room for BOS/EOS/PAD/MASK)")

    def _check_heads(self) -> None:
        if self.kv_channels is not None:
            if self.kv_channels < 2 or self.kv_channels % 2:
                raise ConfigError(f"model.kv_channels={self.kv_channels} must be an even number >= 2 (RoPE rotates "
                                  f"channel pairs)")
        elif self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                              f"{self.num_attention_heads}; pick a head count that divides the hidden size")
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(f"model.num_query_groups={self.query_groups} must divide model.num_attention_heads="
                              f"{self.num_attention_heads}")

    def _check_rope(self) -> None:
        if self.rotary_base <= 0:
            raise ConfigError(f"model.rotary_base={self.rotary_base} must be > 0")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"model.rotary_percent={self.rotary_percent} must be in (0, 1]: the share of each head "
                              f"that carries rotary positions (0 would train without positions)")
        if self.rope_scaling is None:
            return
        _choice(self.rope_scaling, ("llama3",), "model.rope_scaling")
        if self.rope_scaling_factor < 1 or self.rope_original_max_positions < 1:
            raise ConfigError(f"model.rope_scaling=llama3 needs rope_scaling_factor >= 1 (got "
                              f"{self.rope_scaling_factor}) and rope_original_max_positions >= 1 (got "
                              f"{self.rope_original_max_positions})")
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError(f"model.rope_scaling=llama3 needs 0 < rope_low_freq_factor < rope_high_freq_factor "
                              f"(got {self.rope_low_freq_factor}, {self.rope_high_freq_factor})")


def _choice(value, allowed, name):
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}")


def _at_least_one(*pairs) -> None:
    for name, val in pairs:
        if val < 1:
            raise ConfigError(f"{name}={val} must be >= 1")


__all__ = ["ModelConfig"]
