"""Batched KV cache of committed tokens, plugged into the SDPA core attention.

Layout per layer: keys / values [B, g, C + 1, d] (g = KV groups, C = capacity, RoPE already applied
at the tokens' absolute positions; slot C is a write-off slot for masked-out scatters) and ``length``
[B] (valid entries per row). Entries are kept compacted in insertion order: slot s of row b holds the
s-th token of that row that is still cached. *Which* tokens are cached, and which are evicted when the
context budget is reached, is decided by the sampler's :class:`~setdiff_mega.inference.context.Ledger`;
the cache only stores tensors and drops the slots it is told to (:meth:`keep`).

A decode forward over a chunk of T tokens computes attention of the chunk's queries over
``[cache (C slots) ; chunk (T)]`` with a boolean keep-mask [B, 1, T, C + T] that the sampler builds
(cache slots >= length are never visible). The chunk's K/V are held until :meth:`commit` persists the
first ``n[b]`` chunk entries of each row (the committed tokens); the rest (masked queries) are dropped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(self, num_layers: int, batch: int, groups: int, head_dim: int, capacity: int,
                 dtype=torch.float32, device="cpu"):
        self.num_layers, self.batch, self.capacity = num_layers, batch, int(capacity)
        shape = (num_layers, batch, groups, self.capacity + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self._chunk: list = [None] * num_layers

    def valid(self) -> torch.Tensor:
        """[B, C] bool: cache slots holding a committed token."""
        return torch.arange(self.capacity, device=self.length.device)[None] < self.length[:, None]

    def attend(self, layer: int, q, k, v, keep, dropout_p: float = 0.0, scale=None, enable_gqa=False):
        """q [B, h, T, d], k / v [B, g, T, d], keep [B, 1, T, C + T] -> [B, h, T, d]; remembers k, v."""
        self._chunk[layer] = (k, v)
        C = self.capacity
        K = torch.cat([self.k[layer, :, :, :C], k.to(self.k.dtype)], dim=2)
        V = torch.cat([self.v[layer, :, :, :C], v.to(self.v.dtype)], dim=2)
        return F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), attn_mask=keep,
                                              dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)

    def keep(self, keep: torch.Tensor) -> None:
        """Drop the slots where ``keep`` [B, C] is False (among the valid ones); the rest move left in order."""
        C = self.capacity
        keep = keep & self.valid()
        slot = torch.arange(C, device=keep.device)[None]
        key = torch.where(keep, slot, slot + C)                     # kept slots first, in their order
        src = torch.cat([key.argsort(-1), torch.full_like(self.length[:, None], C)], 1)   # [B, C + 1]
        gidx = src[None, :, None, :, None].expand_as(self.k)
        self.k = self.k.gather(3, gidx)
        self.v = self.v.gather(3, gidx)
        self.length = keep.sum(1)

    def commit(self, n: torch.Tensor) -> None:
        """Persist the first n[b] entries of the last chunk of every row."""
        if self._chunk[0] is None:
            raise RuntimeError("commit() without a preceding cached forward")
        T = self._chunk[0][0].shape[2]
        n = n.to(self.length.device)
        if (n > T).any():
            raise ValueError("cannot persist more entries than the chunk holds")
        if (self.length + n > self.capacity).any():
            raise ValueError(f"committing {n.tolist()} entries overflows the cache (capacity {self.capacity}, "
                             f"lengths {self.length.tolist()}); the sampler must evict first")
        j = torch.arange(T, device=n.device)[None]
        dest = torch.where(j < n[:, None], self.length[:, None] + j, torch.full_like(j, self.capacity))  # [B, T]
        for layer, (k, v) in enumerate(self._chunk):
            B, g, _, d = k.shape
            gidx = dest[:, None, :, None].expand(B, g, T, d)
            self.k[layer].scatter_(2, gidx, k.to(self.k.dtype))
            self.v[layer].scatter_(2, gidx, v.to(self.v.dtype))
        self.length = self.length + n
        self._chunk = [None] * self.num_layers

    def discard(self) -> None:
        """Forget the last chunk without persisting anything."""
        self._chunk = [None] * self.num_layers


__all__ = ["KVCache"]
