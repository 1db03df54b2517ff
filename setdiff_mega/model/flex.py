"""FlexAttention core attention ("flex"): the mask's structure as a block-sparse kernel.

For q [b, h, s, d], k / v [b, g, s, d] and a mask that carries a
:class:`~setdiff_mega.diffusion.masks.MaskPattern`, the block mask is built from the pattern's
``mask_mod(b, h, q_idx, kv_idx)`` (structure AND key padding) by ``create_block_mask`` once per pattern and
device and kept in ``pattern.cache``: a static pattern (no padding; the objectives build one per shape) is
analysed once for the whole run, however many layers and steps use it. A context-parallel rank's view
(local query rows x gathered keys) gets its own T_loc x T' block mask from the view's ``mask_mod``.
Fully masked 128 x 128 tiles are skipped, so the set-causal 2L x 2L mask costs about what its allowed pairs cost.

On CUDA ``flex_attention`` is compiled (``torch.compile``, one kernel per shape, forward and backward); on
CPU it runs eagerly and has **no backward** (PyTorch's limitation), so training on CPU with this backend is
refused with a clear error; evaluation and inference on CPU work. Dropout and masks without a pattern
(KV-cached decoding, hand-built masks) go to the dense SDPA path of :class:`SDPACoreAttention`.
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as eager_flex

from .attention import SDPACoreAttention


@functools.cache
def _compiled_flex_attention():
    return torch.compile(eager_flex, dynamic=False)


def block_mask_for(pattern, device: torch.device):
    """The FlexAttention BlockMask of ``pattern`` on ``device`` (built once, cached on the pattern)."""
    key = ("flex_block_mask", str(device))
    if key not in pattern.cache:
        B = pattern.batch_size
        for name in ("key_valid", "rows", "cols", "documents", "local"):    # what mask_mod indexes: on the device
            t = getattr(pattern, name)
            if t is not None and t.device != device:
                setattr(pattern, name, t.to(device))
        pattern.cache[key] = create_block_mask(pattern.mask_mod(), B, None, pattern.num_queries, pattern.num_keys,
                                               device=device)
    return pattern.cache[key]


def flex_attention(q, k, v, pattern, scale=None):
    """q [b, h, T_q, d], k / v [b, g, T_k, d] under ``pattern`` (T_q = T_k = T unless a view) -> [b, h, T_q, d]."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("FlexAttention has no backward on CPU (a PyTorch limitation): train on CPU with "
                           "model.attention_backend=setcausal or sdpa; flex runs forward-only here "
                           "(evaluation, generation)")
    fn = eager_flex if q.device.type == "cpu" else _compiled_flex_attention()
    block_mask = block_mask_for(pattern, q.device)
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class FlexCoreAttention(SDPACoreAttention):
    """Same interface as :class:`SDPACoreAttention`; patterned masks run FlexAttention."""

    def attend(self, q, k, v, attention_mask, pattern):
        if pattern is None:
            return super().attend(q, k, v, attention_mask, pattern)
        if self.active_dropout > 0:
            warnings.warn("attention_backend=flex falls back to the dense-mask SDPA path: FlexAttention has no "
                          "attention dropout (set model.attention_dropout=0 to use it)")
            return super().attend(q, k, v, attention_mask, pattern)
        if (pattern.num_queries, pattern.num_keys) != (q.shape[2], k.shape[2]):
            raise ValueError(f"mask pattern covers {pattern.num_queries} queries x {pattern.num_keys} keys, the "
                             f"input has {q.shape[2]} x {k.shape[2]}")
        return flex_attention(q, k, v, pattern, self.softmax_scale)


__all__ = ["FlexCoreAttention", "flex_attention", "block_mask_for"]
