"""One decode forward over a chunk ``[pending ; queries]``, with the KV cache or its uncached reference.

Per row b the chunk holds P_b pending tokens (committed, K/V not cached yet) then A_b queries (MASK
positions to predict, or a BD3LM block); both are packed [B, P] / [B, A] with validity masks. Visibility:

    pending a  -> cached tokens + pending b with b <= a, or in the same group (BD3LM: one block)
    query      -> cached tokens + every pending token (or those ``query_pending`` [B, A, P] names: the
                  grouped queries of self-speculation, method.md 16) + itself (+ ``query_mask`` among queries)

Before the forward the :class:`~setdiff_mega.decoding.context.Ledger` evicts so that
``cached + P_b + A_b <= budget`` (or ``cached + span_b <= budget`` for a caller that says how many chunk
entries any one row of its chunk attends to: self-speculation's queries see each other never, so
``span_b = P_b + 1``); after it, :meth:`ChunkRunner.persist` makes the pending tokens
cached (their K/V are written; the queries' are dropped: method.md P12).

``use_cache=True``: keys = [KVCache slots ; chunk], mask [B, T, C + T]. With ``static_chunk=(P, A)`` the
pending and query rows are padded with invalid entries to P and A columns (wider chunks keep their
width) and the cache keeps fixed addresses: every decode step has one shape (:mod:`.capture`); the
prefill keeps its own.
``use_cache=False``: the whole insertion history is recomputed in front of the chunk with the mask the
cache implies (:meth:`Ledger.history`), so both modes give the same logits up to float rounding, also
after evictions. A forward whose only purpose is to cache tokens (a prefill) is skipped in that mode.
"""
from __future__ import annotations

import torch

from .cache import KVCache
from .calls import Call
from .context import Ledger


def _pad(idx, ok, width: int, group=None):
    """Packed rows [B, M] padded with invalid entries to ``width`` columns (never narrowed)."""
    extra = width - idx.shape[1]
    if extra <= 0:
        return idx, ok, group
    z = idx.new_zeros(idx.shape[0], extra)
    return (torch.cat([idx, z], 1), torch.cat([ok, z.bool()], 1),
            None if group is None else torch.cat([group, z - 1], 1))


def _pad_visible(qp, A: int, P: int):
    """A query-to-pending mask [B, a, p] padded with False to [B, A, P] (static chunk widths)."""
    out = qp.new_zeros(qp.shape[0], A, P)
    out[:, :qp.shape[1], :qp.shape[2]] = qp
    return out


class ChunkRunner:
    def __init__(self, model, tokens_ref, mask_id: int, pad_id: int, use_cache: bool, budget: int | None,
                 by_position: torch.Tensor | None = None, static_chunk: tuple | None = None):
        self.model, self.mask_id, self.pad_id = model, mask_id, pad_id
        self.static_chunk = static_chunk if use_cache else None     # (pending, query) widths, or None
        self.tokens = tokens_ref
        B, N = tokens_ref.shape
        dev = tokens_ref.device
        self.ledger = Ledger(B, N, budget, by_position, device=dev)
        self.cache = None
        if use_cache:
            layers, groups, head_dim = model.cache_shape()
            p = next(model.parameters())
            capacity = N if budget is None else min(int(budget), N)
            dtype = getattr(model, "cache_dtype", None) or p.dtype           # a model may ask for a narrower cache
            self.cache = KVCache(layers, B, groups, head_dim, capacity, dtype=dtype, device=p.device,
                                 static=self.static_chunk is not None)
        self.forwards = 0     # forward index (also counts skipped prefills: the ledger's clock)
        self.nfe = 0          # model calls
        self._pending = None
        self._layouts: dict = {}

    def reset_row(self, b: int) -> None:
        """Row ``b`` starts a new request (continuous batching): its history and cache entries are gone."""
        self.ledger.reset_row(b)
        if self.cache is not None:
            self.cache.reset_row(b)

    def _chunk(self, pend_idx, pend_ok, q_idx, q_ok, q_tokens, pend_group, query_mask, query_pending=None):
        B, P = pend_idx.shape
        A = q_idx.shape[1]
        T = P + A
        dev = pend_idx.device
        pend_tok = self.tokens.gather(1, pend_idx).masked_fill(~pend_ok, self.pad_id)
        if q_tokens is None:
            q_tokens = torch.full((B, A), self.mask_id, dtype=torch.long, device=dev)
        tok = torch.cat([pend_tok, q_tokens.masked_fill(~q_ok, self.pad_id)], 1)
        posi = torch.cat([pend_idx * pend_ok, q_idx * q_ok], 1)
        ok = torch.cat([pend_ok, q_ok], 1)
        layout, eye = self._layout(P, A, dev)
        allowed = layout                               # the common chunk: no groups, no query mask
        if pend_group is not None or query_mask is not None or query_pending is not None:
            allowed = layout.expand(B, T, T).clone()
            if P and A and query_pending is not None:   # self-speculation: each query group sees its prefix
                allowed[:, P:, :P] = query_pending
            if P and pend_group is not None:          # BD3LM: a block's pending tokens see each other
                allowed[:, :P, :P] |= pend_group[:, :, None] == pend_group[:, None, :]
            if A and query_mask is not None:
                allowed[:, P:, P:] = query_mask
        return tok, posi, ok, (allowed & ok[:, None, :] & ok[:, :, None]) | eye

    def _layout(self, P: int, A: int, dev) -> tuple:
        """([1, T, T] pending causal + queries seeing every pending token, [1, T, T] identity), cached per
        (P, A): the visibility of a chunk before groups, query mask and validity."""
        key = (P, A)
        if key not in self._layouts:
            T = P + A
            layout = torch.zeros(1, T, T, dtype=torch.bool, device=dev)
            layout[:, :P, :P] = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
            layout[:, P:, :P] = True
            self._layouts[key] = (layout, torch.eye(T, dtype=torch.bool, device=dev)[None])
        return self._layouts[key]

    def run(self, pend_idx, pend_ok, q_idx, q_ok, q_tokens=None, pend_group=None, query_mask=None,
            logits_rows: str = "queries", query_pending=None, span=None):
        """One forward, as a generator (:mod:`.calls`: it yields its :class:`~.calls.Call` and is sent the
        logits; ``logits = yield from runner.run(...)``); returns logits [B, A, V] for the queries
        (``logits_rows="all"``: [B, P + A, V]), None for an uncached forward with nothing to predict.
        ``query_pending`` [B, A, P] bool: the pending entries each query sees (default: all); ``span`` [B]: the
        chunk entries any one row attends to, what the context budget must hold (default: P_b + A_b)."""
        f = self.forwards
        self.forwards += 1
        if span is None:
            keep = self.ledger.evict_for(pend_ok.sum(1) + q_ok.sum(1), f, pend_idx.shape[1] + q_idx.shape[1])
        else:
            keep = self.ledger.evict_for(span, f, pend_idx.shape[1] + 1)
        if keep is not None and self.cache is not None:
            self.cache.keep(keep[:, :self.cache.capacity])
        self._pending = (pend_idx, pend_ok, pend_group, f)
        P, A = pend_idx.shape[1], q_idx.shape[1]
        if self.static_chunk is not None and A:          # fixed widths for decode steps (not the prefill)
            pend_idx, pend_ok, pend_group = _pad(pend_idx, pend_ok, self.static_chunk[0], pend_group)
            q_idx, q_ok, _ = _pad(q_idx, q_ok, self.static_chunk[1])
            q_tokens = None if q_tokens is None else _pad(q_tokens, q_ok[:, :A], q_idx.shape[1])[0]
            if query_mask is not None and query_mask.shape[-1] < q_idx.shape[1]:
                qm = torch.zeros(*query_mask.shape[:-2], q_idx.shape[1], q_idx.shape[1], dtype=torch.bool,
                                 device=query_mask.device)
                qm[..., :A, :A] = query_mask
                query_mask = qm
            if query_pending is not None:
                query_pending = _pad_visible(query_pending, q_idx.shape[1], pend_idx.shape[1])
        tok, posi, ok, allowed = self._chunk(pend_idx, pend_ok, q_idx, q_ok, q_tokens, pend_group, query_mask,
                                             query_pending)
        start = 0 if logits_rows == "all" else pend_idx.shape[1]
        if self.cache is not None:
            out = yield from self._cached_forward(tok, posi, allowed, ok, start, pend_ok)
            if logits_rows != "all":
                return out[:, :A]
            return torch.cat([out[:, :P], out[:, pend_idx.shape[1]:pend_idx.shape[1] + A]], 1)
        if start == tok.shape[1]:          # nothing to predict: only the ledger learns about these tokens
            return None
        hpos, hok, hmask = self.ledger.history()
        H = hpos.shape[1]
        B, T = tok.shape
        htok = self.tokens.gather(1, hpos).masked_fill(~hok, self.pad_id)
        seen = hok & (self.ledger.gone[:, :H] > f)
        mask = torch.zeros(B, H + T, H + T, dtype=torch.bool, device=tok.device)
        mask[:, :H, :H] = hmask | torch.eye(H, dtype=torch.bool, device=tok.device)[None]
        mask[:, H:, :H] = seen[:, None, :] & ok[:, :, None]
        mask[:, H:, H:] = allowed
        self.nfe += 1
        return (yield Call(torch.cat([htok, tok], 1), torch.cat([hpos, posi], 1), mask, H + start))

    def _cached_forward(self, tok, posi, allowed, ok, start, pend_ok):
        """The forward through the cache; rows with nothing in the chunk (finished, or free slots of a serving
        session) are left out of it (their logits are zeros, never read). The call says how many pending entries
        lead each row (the rest of the pending columns is padding)."""
        B, T = tok.shape
        keep = torch.cat([self.cache.valid()[:, None, :].expand(B, T, self.cache.capacity), allowed], -1)
        self.nfe += 1
        rows = ok.any(1)
        P = pend_ok.shape[1]
        if B == 1 or self.static_chunk is not None or int(rows.sum()) in (0, B):     # one host sync
            count = None if B == 1 or self.static_chunk is not None else pend_ok.sum(1)
            valid = None if self.static_chunk is not None or B == 1 else ok   # one row: no padding; static: kept
            return (yield Call(tok, posi, keep, start, self.cache, count, P, valid))
        idx = rows.nonzero()[:, 0]
        part = yield Call(tok[idx], posi[idx], keep[idx], start, self.cache.rows(idx), pend_ok[idx].sum(1), P, ok[idx])
        out = part.new_zeros(B, *part.shape[1:])
        out[idx] = part
        return out

    def persist(self, keep: torch.Tensor | None = None) -> None:
        """The pending tokens of the last forward become cached (``keep`` [B, P]: only those, a leading run of
        each row's pending entries: self-speculation caches the accepted drafts, never the rejected ones)."""
        pend_idx, pend_ok, pend_group, f = self._pending
        if keep is not None:
            pend_ok = pend_ok & keep
        self.ledger.append(pend_idx, pend_ok, f, pend_group)
        if self.cache is not None:
            self.cache.commit(pend_ok.sum(1))
        self._pending = None

    @property
    def evicted(self) -> int:
        return self.ledger.evicted


__all__ = ["ChunkRunner"]
