"""Batched KV cache of committed tokens, plugged into the SDPA core attention.

Layout per layer: keys / values [B, g, S, d] (g = KV groups, RoPE already applied at the tokens' absolute
positions) holding a *window* of C slots (the capacity) at an offset o shared by the rows, then a scratch
region for the current chunk:

    [ .. o ) [ window: slots o + s, s < C ) [ chunk: o + C + j, j < T ) [ .. S )

and ``length`` [B] (valid window entries per row). Window entries are kept compacted in insertion order:
slot s of row b holds the s-th token of that row that is still cached. *Which* tokens are cached, and
which are evicted when the context budget is reached, is decided by the sampler's
:class:`~setdiff_mega.decoding.context.Ledger`; the cache only stores tensors and drops the slots it is
told to (:meth:`keep`). Dropping every row's n oldest entries (the usual eviction) only advances o; any
other pattern compacts the window with a gather; the window moves back to offset 0 (one copy) when the
buffer's end is reached. A ``static`` cache always compacts, so o stays 0 and the attended view keeps its
address (captured decode steps, :mod:`.capture`).

Entries are held in the cache's dtype (the model's, or bfloat16 for a model whose ``cache_dtype`` says so:
the reduced-precision decode-weights formats); attention casts the queries to it, never the cache to the
queries' (:func:`attend_in`).

A decode forward over a chunk of T tokens writes the chunk's K/V into the scratch region and computes
attention of the chunk's queries over the contiguous view ``[window (C slots) ; chunk (T)]`` with a
boolean keep-mask [B, 1, T, C + T] that the sampler builds (window slots >= length are never visible): no
concatenation. :meth:`commit` then persists the first ``n[b]`` chunk entries of each row (the committed
tokens), all layers at once: one slice copy when every row commits the same number of entries at the same
length (e.g. batch 1), else one slice copy per committing row on CPU (at GPT-2-small shape and batch 8 about
20x cheaper there than the scatter) and one scatter on an accelerator (a kernel launch per row would cost
more); the rest (masked queries) are dropped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(self, num_layers: int, batch: int, groups: int, head_dim: int, capacity: int,
                 dtype=torch.float32, device="cpu", static: bool = False):
        self.num_layers, self.batch, self.capacity = num_layers, batch, int(capacity)
        self.static = bool(static)          # the window stays at offset 0 (fixed addresses, :mod:`.capture`)
        self._shape = (num_layers, batch, groups, head_dim)
        self.offset, self._T = 0, None
        self._slack = max(64, self.capacity // 4)            # window moves before a copy; the chunk's room
        self.k, self.v = self._alloc(self.capacity + self._slack, dtype, device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)

    def _alloc(self, slots: int, dtype, device):
        L, B, g, d = self._shape
        return (torch.zeros(L, B, g, slots, d, dtype=dtype, device=device),
                torch.zeros(L, B, g, slots, d, dtype=dtype, device=device))

    def _room(self, T: int) -> None:
        """Make the buffer hold the window and a chunk of T entries after it: move the window back to offset
        0 (one copy every ``slack`` evicted entries at most), growing the buffer only for a larger chunk."""
        C, o, size = self.capacity, self.offset, self.k.shape[3]
        if o + C + T <= size:
            return
        if C + T <= size:
            self.k[:, :, :, :C] = self.k[:, :, :, o:o + C].clone()
            self.v[:, :, :, :C] = self.v[:, :, :, o:o + C].clone()
        else:
            k, v = self._alloc(C + T + self._slack, self.k.dtype, self.k.device)
            k[:, :, :, :C] = self.k[:, :, :, o:o + C]
            v[:, :, :, :C] = self.v[:, :, :, o:o + C]
            self.k, self.v = k, v
        self.offset = 0

    def reset_row(self, b: int) -> None:
        """Row ``b`` starts a new request: its window is empty (the other rows' entries do not move)."""
        self.length[b] = 0

    def valid(self) -> torch.Tensor:
        """[B, C] bool: window slots holding a committed token."""
        return torch.arange(self.capacity, device=self.length.device)[None] < self.length[:, None]

    def window(self, layer: int, rows=slice(None)) -> tuple:
        """(keys, values) [b, g, C, d] of the window slots of ``layer`` for ``rows`` (views for a slice)."""
        o, C = self.offset, self.capacity
        return self.k[layer, rows, :, o:o + C], self.v[layer, rows, :, o:o + C]

    def begin(self, T: int) -> None:
        """Reserve the scratch slots of a chunk of T entries (the host-side part of a cached forward). Rows of one
        chunk may run in several forwards (a scheduler cutting padding): the chunk is the widest of them."""
        self._room(T)
        self._T = T if self._T is None else max(self._T, T)

    def write(self, layer: int, k, v, rows=slice(None)) -> None:
        """The chunk's k / v [b, g, T, d] into the scratch slots of ``layer`` for ``rows`` (after :meth:`begin`)."""
        s, T = self.offset + self.capacity, k.shape[2]
        self.k[layer, rows, :, s:s + T] = k.to(self.k.dtype)
        self.v[layer, rows, :, s:s + T] = v.to(self.v.dtype)

    def attend(self, layer: int, q, k, v, keep, dropout_p: float = 0.0, scale=None, enable_gqa=False,
               rows=slice(None), kernel=None):
        """q [b, h, T, d], k / v [b, g, T, d], keep [b, 1, T, C + T] -> [b, h, T, d] for ``rows`` (all: views of
        [window ; chunk], no copy); k, v stay in the scratch region until :meth:`commit` or the next forward.
        ``kernel``: an attention kernel to try before SDPA (:func:`attend_in`)."""
        T = k.shape[2]
        if layer == 0:
            self.begin(T)
        self.write(layer, k, v, rows)
        o, s = self.offset, self.offset + self.capacity
        K, V = self.k[layer, rows, :, o:s + T], self.v[layer, rows, :, o:s + T]
        return attend_in(K.dtype, q, K, V, keep, dropout_p, scale, enable_gqa, kernel)

    def rows(self, idx: torch.Tensor) -> "CacheRows":
        """A view of rows ``idx`` for a forward over those rows only (the others have nothing in the chunk)."""
        return CacheRows(self, idx)

    def keep(self, keep: torch.Tensor) -> None:
        """Drop the slots where ``keep`` [B, C] is False (among the valid ones); the rest move left in order."""
        C, o = self.capacity, self.offset
        valid = self.valid()
        keep = keep & valid
        slot = torch.arange(C, device=keep.device)[None]
        n = valid.sum(1) - keep.sum(1)
        n0 = int(n[0])
        if not self.static and bool((n == n0).all()) and bool(torch.equal(keep, valid & (slot >= n0))):
            # the oldest n0 of every row: only the offset moves (a static cache compacts instead)
            self.offset += n0
        else:
            key = torch.where(keep, slot, slot + C)                 # kept slots first, in their order
            gidx = key.argsort(-1)[None, :, None, :, None].expand(*self.k.shape[:3], C, self.k.shape[4])
            self.k[:, :, :, o:o + C] = self.k[:, :, :, o:o + C].gather(3, gidx)
            self.v[:, :, :, o:o + C] = self.v[:, :, :, o:o + C].gather(3, gidx)
        self.length = keep.sum(1)

    def commit(self, n: torch.Tensor) -> None:
        """Persist the first n[b] entries of the last chunk of every row (all layers at once)."""
        if self._T is None:
            raise RuntimeError("commit() without a preceding cached forward")
        T, o, C = self._T, self.offset, self.capacity
        n = n.to(self.length.device)
        counts, lengths = torch.stack([n, self.length]).tolist()          # one host sync
        if max(counts, default=0) > T:
            raise ValueError("cannot persist more entries than the chunk holds")
        if any(a + b > C for a, b in zip(counts, lengths)):
            raise ValueError(f"committing {counts} entries overflows the cache (capacity {C}, "
                             f"lengths {lengths}); the sampler must evict first")
        self._T = None
        if len(set(counts)) <= 1 and len(set(lengths)) <= 1:   # every row alike (batch 1): one slice copy
            m, at = (counts[0], o + lengths[0]) if counts else (0, o)
            if m:                                              # [at, at + m) and the scratch never overlap
                self.k[:, :, :, at:at + m] = self.k[:, :, :, o + C:o + C + m]
                self.v[:, :, :, at:at + m] = self.v[:, :, :, o + C:o + C + m]
            self.length = self.length + n
            return
        if self.k.device.type == "cpu":        # a slice copy per row: on CPU far cheaper than a scatter
            self._commit_rows(counts, lengths)
        else:
            self._commit_scatter(n, T)
        self.length = self.length + n

    def _commit_rows(self, counts: list, lengths: list) -> None:
        o, C = self.offset, self.capacity
        for b, (m, at) in enumerate(zip(counts, lengths)):
            if m:                                              # all layers at once; never overlaps the scratch
                self.k[:, b, :, o + at:o + at + m] = self.k[:, b, :, o + C:o + C + m]
                self.v[:, b, :, o + at:o + at + m] = self.v[:, b, :, o + C:o + C + m]

    def _commit_scatter(self, n: torch.Tensor, T: int) -> None:
        o, C = self.offset, self.capacity
        j = torch.arange(T, device=n.device)[None]
        dest = torch.where(j < n[:, None], o + self.length[:, None] + j, o + C + j)    # dropped: stay in scratch
        L, B, g, _, d = self.k.shape
        gidx = dest[None, :, None, :, None].expand(L, B, g, T, d)
        self.k.scatter_(3, gidx, self.k[:, :, :, o + C:o + C + T].clone())
        self.v.scatter_(3, gidx, self.v[:, :, :, o + C:o + C + T].clone())

    def discard(self) -> None:
        """Forget the last chunk without persisting anything."""
        self._T = None


def attend_in(dtype, q, K, V, keep, dropout_p: float = 0.0, scale=None, enable_gqa=False, kernel=None):
    """SDPA of q over K / V held in ``dtype`` (the cache's): q and an additive mask are cast to it (the cache is
    never copied into q's precision), the output back to q's dtype. The same dtype: plain SDPA, nothing cast.
    ``kernel(q, K, V, keep, scale)``, when given, is tried first (it returns None where it does not apply: the
    decode-attention kernel of the fp32-packed format, ``hfmodel/cpu_kernels.py``)."""
    if kernel is not None and dropout_p == 0.0:
        out = kernel(q, K, V, keep, scale)
        if out is not None:
            return out
    if keep is not None and keep.dtype != torch.bool:
        keep = keep.to(dtype)
    out = F.scaled_dot_product_attention(q.to(dtype), K, V, attn_mask=keep, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=enable_gqa)
    return out.to(q.dtype)


class CacheRows:
    """Rows ``idx`` of a :class:`KVCache` as a cache for a forward over those rows: their chunk K/V go to their
    scratch slots (persisted by the cache's :meth:`KVCache.commit` as usual) and attention reads their windows
    (gathered: one copy per layer). Used when some rows of a batch have no work in a step (finished rows,
    free slots of a serving session), so the forward skips them."""

    static = False

    def __init__(self, cache: KVCache, idx: torch.Tensor):
        self.cache = cache
        lo, n = int(idx[0]), idx.numel()
        contiguous = int(idx[-1]) - lo + 1 == n                # rows [lo, lo + n): views instead of gathers
        self.idx = slice(lo, lo + n) if contiguous else idx
        self.capacity = cache.capacity

    def begin(self, T: int) -> None:
        self.cache.begin(T)

    def rows(self, idx: torch.Tensor) -> "CacheRows":
        """Rows ``idx`` of these rows."""
        mine = self.idx if isinstance(self.idx, torch.Tensor) else torch.arange(self.idx.start, self.idx.stop)
        return CacheRows(self.cache, mine.to(idx.device)[idx])

    def write(self, layer: int, k, v) -> None:
        self.cache.write(layer, k, v, self.idx)

    def window(self, layer: int) -> tuple:
        return self.cache.window(layer, self.idx)

    def attend(self, layer: int, q, k, v, keep, dropout_p: float = 0.0, scale=None, enable_gqa=False, kernel=None):
        return self.cache.attend(layer, q, k, v, keep, dropout_p, scale, enable_gqa, rows=self.idx, kernel=kernel)


__all__ = ["KVCache", "CacheRows", "attend_in"]
