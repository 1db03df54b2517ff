"""Attention patterns for the four objectives. Convention: a bool mask with True = ALLOWED.

(The model converts to megatron-core's convention, True = masked out, at its boundary.)

Shapes: static masks are [T, T]; per-sample masks are [B, T, T]. Queries are rows, keys columns.

Set-causal mask over the 2L input (method.md section 4.1), in permuted (rank) space, with
i = q mod L and j = k mod L (q, k < L is the clean stream, >= L the noisy stream):

    clean q -> clean k : j <= i        noisy q -> clean k : j <  i
    noisy q -> noisy k : j == i        clean q -> noisy k : never

Rank form in original-position space (no token permutation), rank = perm^-1:
    allowed(q, k) = clean_q & clean_k & rank_k <= rank_q
                  | noisy_q & clean_k & rank_k <  rank_q
                  | noisy_q & noisy_k & pos_k == pos_q
BD3LM block mask with block size S over [x0 ; x_t] (block(p) = p // S):
    clean -> clean: block_k <= block_q;  noisy -> clean: block_k < block_q;
    noisy -> noisy: block_k == block_q;  clean -> noisy: never.
With S = 1 it equals the set-causal mask.

:class:`MaskPattern` names the structure of a mask (causal, full, two-stream block / set-causal, plus
per-sample key padding) so attention kernels can skip the dense [T, T] tensor: FlexAttention builds a
block mask from :meth:`MaskPattern.mask_mod`, the set-causal decomposition needs only the kind. Its
:meth:`~MaskPattern.dense` is the dense mask built by the functions below, so the two cannot disagree.

A pattern can also be a *view* (:meth:`MaskPattern.view`): queries at positions ``rows`` [T_q] and keys at
positions ``cols`` [T_k] of the full T-position pattern, as a context-parallel rank sees it (its own rows,
the keys it gathered in the CP group's order). The view's dense mask is [1|B, T_q, T_k], built from
:meth:`MaskPattern.allowed` on the index pairs: the full T x T mask is never built.

Packed documents (:meth:`MaskPattern.with_documents`): ``documents`` [B, T] long gives each position's document
(-1 on padding); a query attends only to keys of its own document, and the block structure of a two-stream
pattern is counted from the document's start (``local`` [B, T]: the position's slot within its document), so
a packed row of documents d_1..d_m has exactly the mask of each d_i alone, right-padded. Every stream holds
the documents in the same slots, one after another (in rank space too: an order never leaves its document):

    allowed(b, q, k) = structure(local[b, q], local[b, k], streams of q, k) & documents[b, q] == documents[b, k]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


def causal_mask(T: int, device=None) -> torch.Tensor:
    """[T, T]: k <= q."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def bidirectional_mask(T: int, device=None) -> torch.Tensor:
    """[T, T]: all pairs allowed (padding is added with :func:`with_key_padding`)."""
    return torch.ones(T, T, dtype=torch.bool, device=device)


def _two_stream(cc: torch.Tensor, nc: torch.Tensor, nn: torch.Tensor) -> torch.Tensor:
    """Assemble [..., 2L, 2L] from the clean->clean, noisy->clean and noisy->noisy [..., L, L] blocks."""
    none = torch.zeros_like(cc)
    top = torch.cat([cc, none], dim=-1)
    bottom = torch.cat([nc, nn], dim=-1)
    return torch.cat([top, bottom], dim=-2)


def block_diffusion_mask(L: int, block_size: int, device=None) -> torch.Tensor:
    """[2L, 2L] BD3LM mask over [x0 ; x_t] with blocks of ``block_size`` positions."""
    blk = torch.arange(L, device=device) // block_size
    bq, bk = blk[:, None], blk[None, :]
    return _two_stream(bk <= bq, bk < bq, bk == bq)


def setcausal_mask(L: int, device=None) -> torch.Tensor:
    """[2L, 2L] static set-causal mask in permuted (rank) space."""
    r = torch.arange(L, device=device)
    rq, rk = r[:, None], r[None, :]
    return _two_stream(rk <= rq, rk < rq, rk == rq)


def setcausal_mask_from_ranks(rank: torch.Tensor) -> torch.Tensor:
    """[B, 2L, 2L] set-causal mask in original-position space from ``rank`` [B, L]."""
    rq, rk = rank[:, :, None], rank[:, None, :]
    L = rank.shape[-1]
    eye = torch.eye(L, dtype=torch.bool, device=rank.device).expand(rank.shape[0], L, L)
    return _two_stream(rk <= rq, rk < rq, eye)


def with_key_padding(mask: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """AND a key-validity mask ``valid`` [B, T] into ``mask`` [T, T] or [B, T, T] -> [B, T, T].

    Invalid (padding) keys are hidden from every query; a padding query additionally keeps itself so
    no row is empty (a fully masked softmax row would be NaN). Padding rows never enter a loss. Returns
    ``mask`` unchanged if ``valid`` is None.
    """
    if valid is None:
        return mask
    T = valid.shape[-1]
    eye = torch.eye(T, dtype=torch.bool, device=valid.device)
    return (mask & valid[:, None, :]) | (eye & ~valid[:, :, None])


def document_runs(documents: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(id, start, end)] of the documents of one packed row [n] (ids >= 0, each one run, then only -1)."""
    n = documents.numel()
    new = torch.ones(n, dtype=torch.bool, device=documents.device)
    new[1:] = documents[1:] != documents[:-1]
    starts = torch.nonzero(new)[:, 0].tolist()
    ids = documents[starts].tolist()
    runs = [(d, s, e) for d, s, e in zip(ids, starts, starts[1:] + [n]) if d >= 0]
    if len({d for d, _, _ in runs}) != len(runs) or -1 in ids[:-1] or not runs:
        raise ValueError(f"a packed row must hold each document as one run of positions, the padding (-1) last; "
                         f"got runs {list(zip(ids, starts, starts[1:] + [n]))}")
    return runs


PATTERN_KINDS = ("causal", "full", "two_stream")


@dataclass(eq=False)
class MaskPattern:
    """The structure of an attention mask (True = allowed) over T positions.

    * ``causal``: k <= q.   * ``full``: every pair.
    * ``two_stream``: T = 2L, the BD3LM block mask with ``block_size`` S over [clean ; noisy]; S = 1 is the
      static set-causal mask in rank space.
    * ``key_valid`` [B, T] (optional): :func:`with_key_padding` on top (invalid keys hidden from every
      query, an invalid query keeps itself).

    * ``rows`` [T_q] / ``cols`` [T_k] (optional, long): a view, queries and keys at these positions of the
      T-position pattern (None: every position in order).

    * ``documents`` / ``local`` [B, T] (optional, long): packed documents (module docstring).

    ``cache`` holds what kernels derive from the pattern (a FlexAttention block mask, checks), so a
    pattern built once per shape is analysed once, whatever the number of layers and steps.
    """

    kind: str
    length: int
    block_size: int = 1
    key_valid: Optional[torch.Tensor] = None
    cache: dict = field(default_factory=dict, repr=False)
    rows: Optional[torch.Tensor] = None
    cols: Optional[torch.Tensor] = None
    documents: Optional[torch.Tensor] = None
    local: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.kind not in PATTERN_KINDS:
            raise ValueError(f"unknown mask pattern {self.kind!r}; one of {PATTERN_KINDS}")
        if self.kind == "two_stream" and (self.length % 2 or (self.length // 2) % self.block_size):
            raise ValueError(f"two_stream pattern needs an even length whose half is a multiple of the block "
                             f"size, got T={self.length}, S={self.block_size}")

    @property
    def is_setcausal(self) -> bool:
        return self.kind == "two_stream" and self.block_size == 1

    @property
    def is_view(self) -> bool:
        return self.rows is not None or self.cols is not None

    @property
    def plain_causal(self) -> bool:
        """Causal over the whole input: no padding, no documents, not a view (SDPA's mask-free causal kernel)."""
        return self.kind == "causal" and not self.is_view and self.key_valid is None and self.documents is None

    @property
    def batch_size(self):
        """Rows of the per-sample parts (padding, documents), or None for a pattern shared by every row."""
        per_row = self.key_valid if self.key_valid is not None else self.documents
        return None if per_row is None else per_row.shape[0]

    @property
    def num_queries(self) -> int:
        return self.length if self.rows is None else int(self.rows.numel())

    @property
    def num_keys(self) -> int:
        return self.length if self.cols is None else int(self.cols.numel())

    def with_padding(self, key_valid: torch.Tensor | None) -> "MaskPattern":
        """The same structure with per-sample key validity [B, T] (None: unchanged)."""
        if key_valid is None:
            return self
        if self.is_view:
            raise ValueError("add key padding to the full pattern, then take the view")
        return MaskPattern(self.kind, self.length, self.block_size, key_valid.bool(), documents=self.documents,
                           local=self.local)

    def with_documents(self, documents: torch.Tensor) -> "MaskPattern":
        """The same structure restricted to packed documents ``documents`` [B, T] (long, -1 on padding; each
        document one run of slots per stream, at the same slots in every stream)."""
        if self.is_view:
            raise ValueError("packed documents and views (context parallelism) do not combine")
        docs = documents.long()
        streams = 2 if self.kind == "two_stream" else 1
        per = docs.view(docs.shape[0], streams, -1)
        slot = torch.arange(per.shape[-1], device=docs.device).expand_as(per)
        new = torch.ones_like(per, dtype=torch.bool)
        new[..., 1:] = per[..., 1:] != per[..., :-1]
        start = torch.where(new, slot, torch.zeros_like(slot)).cummax(-1).values    # the slot its run starts at
        local = (slot - start).view_as(docs)
        return MaskPattern(self.kind, self.length, self.block_size, self.key_valid, documents=docs, local=local)

    def document_slots(self) -> list[list[tuple[int, int]]]:
        """Packed rows: per row, the [start, end) slots of its documents in a stream (the same in every stream;
        cached)."""
        if "document_slots" not in self.cache:
            per = self.documents.view(self.documents.shape[0], 2 if self.kind == "two_stream" else 1, -1)[:, 0]
            self.cache["document_slots"] = [[(s, e) for _, s, e in document_runs(row)] for row in per.cpu()]
        return self.cache["document_slots"]

    def view(self, rows: torch.Tensor, cols: torch.Tensor) -> "MaskPattern":
        """Queries at positions ``rows``, keys at ``cols`` (long tensors) of this full pattern."""
        if self.is_view:
            raise ValueError("a view of a view: take the view of the full pattern")
        for name, t in (("rows", rows), ("cols", cols)):
            if t.dim() != 1 or (t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.length)):
                raise ValueError(f"pattern view {name} must be positions in [0, {self.length}), got {t.tolist()}")
        return MaskPattern(self.kind, self.length, self.block_size, self.key_valid, rows=rows.long(),
                           cols=cols.long())

    def _index(self, device):
        """(query positions [T_q], key positions [T_k]) on ``device``."""
        q = torch.arange(self.length, device=device) if self.rows is None else self.rows.to(device)
        k = torch.arange(self.length, device=device) if self.cols is None else self.cols.to(device)
        return q, k

    def allowed(self, q: torch.Tensor, k: torch.Tensor, lq=None, lk=None) -> torch.Tensor:
        """Structure only (no padding, no documents), for broadcastable integer index tensors q, k; ``lq`` /
        ``lk``: the slots the two-stream blocks are counted in (default: the slot in the stream)."""
        if self.kind == "causal":
            return k <= q
        if self.kind == "full":
            return (q >= 0) & (k >= 0)
        L, S = self.length // 2, self.block_size
        qc, kc = q < L, k < L
        bq = (q % L if lq is None else lq) // S
        bk = (k % L if lk is None else lk) // S
        return (qc & kc & (bk <= bq)) | (~qc & kc & (bk < bq)) | (~qc & ~kc & (bk == bq))

    def _allowed_in_documents(self, b, q, k, docs=None, local=None) -> torch.Tensor:
        """Structure restricted to packed documents, for broadcastable batch / query / key index tensors."""
        docs = self.documents if docs is None else docs
        local = self.local if local is None else local
        return self.allowed(q, k, local[b, q], local[b, k]) & (docs[b, q] == docs[b, k])

    def mask_mod(self):
        """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` of the whole pattern, padding included."""
        valid, rows, cols = self.key_valid, self.rows, self.cols

        def mod(b, h, q_idx, kv_idx):
            if rows is not None:
                q_idx = rows[q_idx]
            if cols is not None:
                kv_idx = cols[kv_idx]
            ok = self.allowed(q_idx, kv_idx) if self.documents is None else \
                self._allowed_in_documents(b, q_idx, kv_idx)
            if valid is None:
                return ok
            return (ok & valid[b, kv_idx]) | ((q_idx == kv_idx) & ~valid[b, q_idx])
        return mod

    def dense(self, device=None) -> torch.Tensor:
        """The dense mask [1|B, T, T] (what the objectives pass as ``attention_mask``); a view's is
        [1|B, T_q, T_k], built from the index pairs."""
        if self.is_view:
            q, k = self._index(device)
            m = self.allowed(q[:, None], k[None, :])
            if self.key_valid is None:
                return m[None]
            valid = self.key_valid.to(m.device)
            return (m & valid[:, None, k]) | ((q[:, None] == k[None, :]) & ~valid[:, q, None])
        T = self.length
        if self.documents is not None:
            b = torch.arange(self.documents.shape[0], device=device)[:, None, None]
            idx = torch.arange(T, device=device)
            m = self._allowed_in_documents(b, idx[None, :, None], idx[None, None, :], self.documents.to(device),
                                           self.local.to(device))
            return m if self.key_valid is None else with_key_padding(m, self.key_valid.to(device))
        if self.kind == "causal":
            m = causal_mask(T, device)
        elif self.kind == "full":
            m = bidirectional_mask(T, device)
        else:
            m = block_diffusion_mask(T // 2, self.block_size, device)
        if self.key_valid is None:
            return m[None]
        return with_key_padding(m, self.key_valid.to(m.device))

    def valid_keys_first(self) -> bool:
        """True if, within each stream, every valid position comes before every invalid one (right padding
        in rank order): then no valid query of a causal / set-causal pattern can reach a padding key."""
        if self.key_valid is None:
            return True
        streams = self.key_valid.view(self.key_valid.shape[0], 2 if self.kind == "two_stream" else 1, -1)
        return not bool((streams[..., 1:] & ~streams[..., :-1]).any())


def merge_patterns(patterns: list, batch_sizes: list[int]) -> Optional[MaskPattern]:
    """The pattern of a batch concatenated from parts of ``batch_sizes`` rows (None if the parts differ in
    structure or one has none)."""
    first = patterns[0]
    if first is None or any(p is None or (p.kind, p.length, p.block_size) != (first.kind, first.length,
                                                                                first.block_size)
                            for p in patterns):
        return None
    packed = [p.documents is not None for p in patterns]
    if any(packed) and not all(packed):
        return None                              # packed and unpacked rows: no shared structure
    if all(p is first for p in patterns) and first.key_valid is None and not any(packed):
        return first
    merged = MaskPattern(first.kind, first.length, first.block_size)
    if any(p.key_valid is not None for p in patterns):
        rows = [p.key_valid if p.key_valid is not None else torch.ones(n, p.length, dtype=torch.bool)
                for p, n in zip(patterns, batch_sizes)]
        dev = next(p.key_valid.device for p in patterns if p.key_valid is not None)
        merged = merged.with_padding(torch.cat([r.to(dev) for r in rows], 0))
    if any(packed):
        merged = merged.with_documents(torch.cat([p.documents.expand(n, -1) for p, n in zip(patterns, batch_sizes)]))
    return merged


__all__ = ["MaskPattern", "merge_patterns", "document_runs", "causal_mask", "bidirectional_mask",
           "block_diffusion_mask",
           "setcausal_mask", "setcausal_mask_from_ranks", "with_key_padding"]
