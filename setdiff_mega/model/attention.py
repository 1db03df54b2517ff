"""Core attention backends plugged into megatron-core's SelfAttention through the layer spec.

megatron-core hands core attention q [s, b, h, d], k and v [s, b, g, d] (g = query groups, after RoPE)
and a bool ``attention_mask`` [b|1, 1, s, s] with **True = masked out**. The backends return the
context [s, b, h*d]:

* :class:`SDPACoreAttention` ("sdpa", default): ``torch.nn.functional.scaled_dot_product_attention``
  with the arbitrary mask (on CPU about 23% faster than mcore's local DotProductAttention; on GPU it
  picks PyTorch's mask-capable kernels).
* mcore's own ``DotProductAttention`` ("local"), the unfused reference.

Every mask pattern (causal, bidirectional, block, set-causal, per-sample padding) is data: the backend
never special-cases an objective. During decoding :class:`SDPACoreAttention` attends over a
:class:`~setdiff_mega.inference.cache.KVCache` of committed tokens followed by the current chunk; the
mask then has shape [b, 1, s, C + s].
"""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """Same constructor and forward signature as megatron-core's ``DotProductAttention``."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **_unused):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.layer_number = layer_number
        self.kv_cache = None          # set by SetDiffusionTransformer.use_cache() during decoding
        self.cache_layer = 0

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention takes padded [s, b] batches, not packed (THD) sequences; "
                             "use the Transformer Engine spec for packed inputs")
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention takes a boolean attention mask, not an additive attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))   # [b, h, s, d]
        keep = None if attention_mask is None else ~attention_mask
        s, b = query.shape[0], query.shape[1]
        if self.kv_cache is not None:     # decode step: keys = [cache ; chunk], keep [b, 1, s, C + s]
            out = self.kv_cache.attend(self.cache_layer, q, k, v, keep, scale=self.softmax_scale,
                                       enable_gqa=self.heads != self.groups)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=attention_mask is None, scale=self.softmax_scale,
            enable_gqa=self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


ATTENTION_BACKENDS = ("sdpa", "local")

__all__ = ["SDPACoreAttention", "ATTENTION_BACKENDS"]
