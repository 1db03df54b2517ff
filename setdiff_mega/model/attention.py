"""Core attention backends plugged into megatron-core's SelfAttention through the layer spec.

megatron-core hands core attention q [s, b, h, d], k and v [s, b, g, d] (g = query groups, after RoPE)
and a bool ``attention_mask`` [b|1, 1, s, s] with **True = masked out**. The backends return the
context [s, b, h*d]:

* :class:`SDPACoreAttention` ("sdpa", default): the dense-mask reference,
  ``torch.nn.functional.scaled_dot_product_attention`` with the arbitrary mask (on CPU about 23% faster
  than mcore's local DotProductAttention; on GPU it picks PyTorch's mask-capable kernels). A mask whose
  pattern is plain causal without padding runs SDPA's mask-free causal kernel (flash on GPU).
* :class:`~setdiff_mega.model.flex.FlexCoreAttention` ("flex"): FlexAttention with a block mask built
  once per pattern from its ``mask_mod`` (compiled on GPU; CPU runs forward only, no backward there).
* :class:`~setdiff_mega.model.setcausal.SetCausalCoreAttention` ("setcausal"): the mask-free set-causal
  decomposition for set-causal patterns, SDPA for every other mask.
* the implementation's own core attention ("local": mcore ``DotProductAttention``, or TE's with the
  Transformer Engine spec), the unfused reference.

Under context parallelism (:mod:`setdiff_mega.parallel.context`) every backend gets local queries and
the keys / values gathered over the CP group (:meth:`SDPACoreAttention.forward`), with the mask's rows
[b|1, 1, s_loc, s] and the pattern's view (local rows x gathered keys) for the structured kernels.

The structure of the mask comes from the pattern attached to the mask tensor by the model
(``attention_mask.attention_pattern``, :class:`setdiff_mega.diffusion.masks.MaskPattern`); without one
the mask is data: no backend special-cases an objective. During decoding :class:`SDPACoreAttention` attends over a
:class:`~setdiff_mega.decoding.cache.KVCache` of committed tokens followed by the current chunk; the
mask then has shape [b, 1, s, C + s].
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.transformer.module import MegatronModule

from setdiff_mega.parallel.context import gather_sequence


class SDPACoreAttention(MegatronModule):
    """Same constructor and forward signature as megatron-core's ``DotProductAttention``."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **_unused):
        super().__init__(config=config)

        tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.layer_number = layer_number
        self.kv_cache = None          # set by SetDiffusionTransformer.use_cache() during decoding
        self.cache_layer = 0
        self.cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention takes padded [s, b] batches, not packed (THD) sequences; "
                             "use the Transformer Engine spec for packed inputs")
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention takes a boolean attention mask, not an additive attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))   # [b, h, s, d]
        s, b = query.shape[0], query.shape[1]
        if self.kv_cache is not None:     # decode step: keys = [cache ; chunk], keep [b, 1, s, C + s]
            keep = None if attention_mask is None else ~attention_mask
            out = self.kv_cache.attend(self.cache_layer, q, k, v, keep, scale=self.softmax_scale,
                                       enable_gqa=self.heads != self.groups)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if self.cp > 1:                   # context parallelism: local queries, keys / values of every CP rank
            k, v = (gather_sequence(t.permute(2, 0, 1, 3)).permute(1, 2, 0, 3) for t in (k, v))
        pattern = mask_pattern(attention_mask)
        out = self.attend(q, k, v, attention_mask, pattern)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    @property
    def active_dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def attend(self, q, k, v, attention_mask, pattern):
        """q [b, h, s, d], k / v [b, g, s, d], mcore mask (True = masked out) -> [b, h, s, d]."""
        causal = attention_mask is None or (pattern is not None and pattern.plain_causal
                                            and pattern.length == q.shape[2])
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if causal else allowed_mask(attention_mask), dropout_p=self.active_dropout,
            is_causal=causal, scale=self.softmax_scale, enable_gqa=self.heads != self.groups)


def mask_pattern(attention_mask):
    """The :class:`~setdiff_mega.diffusion.masks.MaskPattern` the model attached to this mask, or None."""
    return getattr(attention_mask, "attention_pattern", None)


def lazy_mask(pattern, device):
    """A placeholder for the dense mask of ``pattern`` (an empty tensor carrying the pattern): the core
    attentions that need the dense mask build it once per pattern (:func:`allowed_mask`), the structured
    ones (set-causal decomposition, FlexAttention) never do."""
    m = torch.empty(0, dtype=torch.bool, device=device)
    m.attention_pattern = pattern
    return m


def allowed_mask(attention_mask):
    """The boolean mask with True = allowed [b|1, 1, s, s_k]: mcore's mask inverted, or a placeholder's
    pattern built densely once (cached on the pattern, shared by every layer)."""
    if attention_mask.numel() or mask_pattern(attention_mask) is None:
        return ~attention_mask
    pattern, key = attention_mask.attention_pattern, ("dense_allowed", str(attention_mask.device))
    if key not in pattern.cache:
        pattern.cache[key] = pattern.dense(attention_mask.device)[:, None]
    return pattern.cache[key]


def expand_groups(t, heads: int):
    """[b, g, s, d] -> [b, heads, s, d] (query head i uses KV group i // (heads / g), as in SDPA's GQA)."""
    g = t.shape[1]
    return t if g == heads else t.repeat_interleave(heads // g, dim=1)


__all__ = ["SDPACoreAttention", "mask_pattern", "expand_groups", "lazy_mask", "allowed_mask"]
