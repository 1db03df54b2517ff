"""The SetDLM sampler: sliding-window sets with a KV-cache commit after every step (method.md 5).

Per step, for every row with masked positions left:

    f       = leftmost masked position
    active  = masked positions in [f, f + W)                       (a positional window, P10)
    chunk   = [pending: tokens committed at the previous step, ascending position ;
               active: MASK at each active position]
    mask    = pending row a: cache + pending rows 0..a             (causal among new commits)
              active row:    cache + all pending + itself          (never another MASK, P13)
    logits  = model(chunk, absolute positions, mask) on the active rows
    persist the pending rows' K/V (the deferred, fused cache write, P12); drop the active rows' K/V
    commit  = top-k confident active positions U {confidence >= tau}   (P11)

Prefill: every visible token (the prompt; for infilling the prefix AND the suffix) in position order,
causally, into the cache, so infilled tokens see both sides. The last step's commits are never
cached. ``use_cache=False`` recomputes every step from scratch over all committed tokens in insertion
order (the order in which the cache would have received them), which is mathematically the same
computation: tests use it to prove the cache changes nothing. Rows of a batch commit different numbers
of tokens per step; all bookkeeping is batched tensors (:func:`~setdiff_mega.inference.base.pack`).
"""
from __future__ import annotations

import torch

from .base import Canvas, DecodeState, GenerationConfig, first_true, pack
from .cache import KVCache
from .sampling import choose_tokens, commit_mask


class ChunkRunner:
    """Builds [pending ; queries] chunks and runs them with or without the KV cache."""

    def __init__(self, model, tokens_ref, mask_id: int, pad_id: int, use_cache: bool, capacity: int):
        self.model, self.mask_id, self.pad_id, self.use_cache = model, mask_id, pad_id, use_cache
        self.tokens = tokens_ref
        B = tokens_ref.shape[0]
        self.cache = None
        if use_cache:
            layers, groups, head_dim = model.cache_shape()
            p = next(model.parameters())
            self.cache = KVCache(layers, B, groups, head_dim, capacity, dtype=p.dtype, device=p.device)
        self.nfe = 0

    def run(self, pend_idx, pend_ok, q_idx, q_ok, q_tokens=None, pending_mask=None, query_mask=None,
            logits_rows: str = "queries"):
        """One forward. pending rows attend cache + earlier pending rows (``pending_mask`` [B, P, P]
        overrides the causal rule), query rows attend cache + all pending + themselves (``query_mask``
        [B, A, A] adds visibility among queries). Returns logits for the query rows (or all rows)."""
        B, P = pend_idx.shape
        A = q_idx.shape[1]
        T = P + A
        dev = pend_idx.device
        pend_tok = self.tokens.gather(1, pend_idx).masked_fill(~pend_ok, self.pad_id)
        if q_tokens is None:
            q_tokens = torch.full((B, A), self.mask_id, dtype=torch.long, device=dev)
        q_tokens = q_tokens.masked_fill(~q_ok, self.pad_id)
        tok = torch.cat([pend_tok, q_tokens], 1)
        posi = torch.cat([pend_idx * pend_ok, q_idx * q_ok], 1)
        ok = torch.cat([pend_ok, q_ok], 1)
        allowed = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
        if P:
            pm = torch.ones(P, P, dtype=torch.bool, device=dev).tril()[None] if pending_mask is None else pending_mask
            allowed[:, :P, :P] = pm
            allowed[:, P:, :P] = True
        if A and query_mask is not None:
            allowed[:, P:, P:] = query_mask
        allowed = allowed & ok[:, None, :] & ok[:, :, None]
        allowed |= torch.eye(T, dtype=torch.bool, device=dev)[None]
        start = P if logits_rows == "queries" else 0
        self.nfe += 1
        if self.cache is None:
            return self.model(tok, posi, allowed, start), posi
        cache_part = self.cache.valid()[:, None, :].expand(B, T, self.cache.capacity)
        keep = torch.cat([cache_part, allowed], -1)
        with self.model.use_cache(self.cache):
            logits = self.model(tok, posi, keep, start)
        return logits, posi

    def persist(self, count, posi):
        if self.cache is not None:
            self.cache.commit(count, posi)


class SetDLMSampler:
    """Decode a :class:`Canvas` with sliding-window sets (see the module docstring)."""

    def __init__(self, model, mask_id: int, pad_id: int, eos_id: int, config: GenerationConfig, tokenizer=None):
        self.model, self.mask_id, self.pad_id, self.eos_id = model, mask_id, pad_id, eos_id
        self.cfg = config.validate()
        self.tokenizer = tokenizer

    @torch.no_grad()
    def generate(self, canvas: Canvas):
        cfg = self.cfg
        st = DecodeState(canvas, cfg, self.eos_id)
        B, N = st.tokens.shape
        dev = st.tokens.device
        runner = ChunkRunner(self.model, st.tokens, self.mask_id, self.pad_id, cfg.use_cache, cfg.cache_capacity or N)
        # insertion order of committed tokens (drives the uncached path and the cache contents)
        inserted = torch.zeros(B, N, dtype=torch.long, device=dev)
        n_ins = torch.zeros(B, dtype=torch.long, device=dev)
        pend_idx, pend_ok, pend_cnt = pack(canvas.valid & ~st.masked)       # the visible tokens
        inserted, n_ins = _append(inserted, n_ins, pend_idx, pend_ok)
        if cfg.use_cache and pend_idx.shape[1]:
            _, posi = runner.run(pend_idx, pend_ok, pend_idx[:, :0], pend_ok[:, :0])     # prefill
            runner.persist(pend_cnt, posi)
            pend_idx, pend_ok, pend_cnt = pend_idx[:, :0], pend_ok[:, :0], pend_cnt * 0
        step = 0
        while True:
            live = st.live()
            if not live.any():
                break
            f = first_true(live)
            active = live & (st.pos[None] < (f + cfg.window)[:, None])
            q_idx, q_ok, _ = pack(active)
            if cfg.use_cache:
                logits, posi = runner.run(pend_idx, pend_ok, q_idx, q_ok)
                runner.persist(pend_cnt, posi)
            else:
                all_idx, all_ok, _ = _inserted_view(inserted, n_ins)
                logits, _ = runner.run(all_idx, all_ok, q_idx, q_ok)
            x, conf = choose_tokens(logits, [self.mask_id, self.pad_id], cfg.temperature, cfg.top_p, st.generator)
            sel = st.commit(q_idx, commit_mask(conf, q_ok, cfg.tau, cfg.commit_k), x, active)
            pend_idx, pend_ok, pend_cnt = pack(sel)
            inserted, n_ins = _append(inserted, n_ins, pend_idx, pend_ok)
            step += 1
            if cfg.stop_strings and self.tokenizer is not None and step % cfg.window == 0:
                limit = (f + cfg.window).clamp(max=N)
                st.stop(_stop_strings(self.tokenizer, st.tokens, st.masked, canvas, st.done, limit,
                                      cfg.stop_strings), limit)
            st.end_step()
        return st.output(runner.nfe)


def _append(inserted, n_ins, idx, ok):
    """Append the packed positions ``idx[ok]`` to each row's insertion list."""
    if idx.shape[1] == 0:
        return inserted, n_ins
    B, N = inserted.shape
    j = torch.arange(idx.shape[1], device=idx.device)[None]
    dest = torch.where(ok, n_ins[:, None] + j, torch.full_like(j, N))
    ext = torch.cat([inserted, torch.zeros(B, 1, dtype=inserted.dtype, device=inserted.device)], 1)
    ext.scatter_(1, dest, idx)
    return ext[:, :N], n_ins + ok.sum(1)


def _inserted_view(inserted, n_ins):
    M = int(n_ins.max()) if n_ins.numel() else 0
    ok = torch.arange(M, device=inserted.device)[None] < n_ins[:, None]
    return inserted[:, :M] * ok, ok, n_ins


def _stop_strings(tokenizer, tokens, masked, canvas, done, limit, stop_strings):
    """Rows whose decoded generation (up to ``limit``, MASKs dropped) contains a stop string."""
    B, N = tokens.shape
    newly = torch.zeros(B, dtype=torch.bool, device=tokens.device)
    for b in range(B):
        if done[b] or canvas.infill[b]:
            continue
        e = int(min(int(limit[b]), N))
        keep = canvas.generate[b, :e] & ~masked[b, :e]
        text = tokenizer.decode(tokens[b, :e][keep].tolist())
        newly[b] = any(s in text for s in stop_strings)
    return newly


__all__ = ["SetDLMSampler", "ChunkRunner"]
