"""Baseline samplers with the same interface as the SetDLM sampler.

* :class:`ARSampler` (next-token model, KV cache): prefill the prompt causally; each step feeds the
  last committed token, persists its K/V and reads the next token from its logits. One token per step;
  stopping criteria every step. Infill requests keep only the left context (AR cannot see the right
  side) and fill the span.
* :class:`BD3LMSampler` (block diffusion, KV cache per block): blocks of S positions aligned to
  absolute positions. Inside the current block the noisy tokens attend the cache (clean earlier
  blocks) and every token of their own block; each step commits the top-k + tau set of the block's
  masked positions. When a block is complete its clean tokens are written to the cache in the next
  forward, fused with the next block's first prediction: chunk = [clean block ; noisy next block],
  clean rows see cache + their block (bidirectional within the block, as in training). Stopping
  criteria when a block is complete, on the prefix up to its end (the reference's rule).
* :class:`MDLMSampler` (masked diffusion, no cache): a fixed canvas, full bidirectional recompute each
  step, semi-autoregressive blocks of ``block_size`` positions from the start of the generation region,
  top-k + tau commits inside the current block (committed tokens are never changed: SUBS). A canvas
  longer than the context L is seen through a window of L positions ending at the current block's end
  (or at L), positions absolute.

AR and BD3LM keep cache + chunk <= L like SetDLM (:mod:`.context`); ``use_cache=False`` gives their
uncached reference (the whole history recomputed with the visibility the cache implies). A model with
``shift_logits`` (method.md 13) is read with the AR shift of its training objective (:mod:`.shift`); AR
decoding is shifted by nature and unchanged.
"""
from __future__ import annotations

import torch

from .base import Canvas, DecodeState, GenerationConfig, first_true, pack
from .processors import LogitsPipeline
from .runner import ChunkRunner
from .sampling import commit_mask, resolve_rule
from .setdlm import context_budget
from .shift import block_rows, view_rows


class _Base:
    def __init__(self, model, mask_id: int, pad_id: int, eos_id: int, config: GenerationConfig, tokenizer=None,
                 order_prior=None):
        self.model, self.mask_id, self.pad_id, self.eos_id = model, mask_id, pad_id, eos_id
        self.cfg = config.validate()
        self.tokenizer = tokenizer
        self.shift = bool(getattr(model, "shift_logits", False))
        self.rule = resolve_rule(self.cfg.commit_rule, anchored=False)     # "auto": the paper's rule here
        self.observer = None           # called with the DecodeState after every step (DecodeState.observer)

    def _start(self, canvas: Canvas):
        st = DecodeState(canvas, self.cfg, self.eos_id, self.mask_id, self.tokenizer, self.observer)
        return st, LogitsPipeline(self.cfg, self.mask_id, self.eos_id)


class ARSampler(_Base):
    @torch.no_grad()
    def generate(self, canvas: Canvas):
        cfg = self.cfg
        st, choose = self._start(canvas)
        B, N = st.tokens.shape
        runner = ChunkRunner(self.model, st.tokens, self.mask_id, self.pad_id, cfg.use_cache,
                             context_budget(self.model, cfg))
        first = first_true(st.masked)
        if bool((first == 0).any()):
            raise ValueError("AR decoding needs at least one visible token (e.g. BOS) before the first MASK")
        pend = canvas.valid & (st.pos[None] < first[:, None])         # left context only (also for infill)
        while True:
            live = st.live()
            if not live.any():
                break
            idx, ok, cnt = pack(pend)
            logits = runner.run(idx, ok, idx[:, :0], ok[:, :0], logits_rows="all")
            runner.persist()
            last = (cnt - 1).clamp(min=0)
            target = first_true(live).clamp(max=N - 1)                 # the next position to fill
            x, conf = choose(logits.gather(1, last[:, None, None].expand(B, 1, logits.shape[-1])), target[:, None], st)
            pend = st.commit(target[:, None], (~st.done)[:, None], x, live, conf)
            st.end_step()
            if st.criteria.enabled:
                st.check_stops(first_true(st.masked))
        return st.output(runner.nfe, runner.evicted)


def _completed(st: DecodeState, before: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Rows whose ``block`` [B, N] region had masked positions ``before`` and has none now."""
    return before & ~(st.masked & block).any(1) & ~st.done


class BD3LMSampler(_Base):
    @torch.no_grad()
    def generate(self, canvas: Canvas):
        cfg = self.cfg
        st, choose = self._start(canvas)
        B, N = st.tokens.shape
        blk = st.pos // cfg.block_size
        runner = ChunkRunner(self.model, st.tokens, self.mask_id, self.pad_id, cfg.use_cache,
                             context_budget(self.model, cfg))
        cached_blocks = torch.zeros(B, dtype=torch.long, device=st.tokens.device)   # blocks [0, n) are cached
        edge = None                      # shift_logits: the clean row of the current block's predecessor
        while True:
            live = st.live()
            if not live.any():
                break
            cur = torch.where(live.any(1), blk[first_true(live).clamp(max=N - 1)], blk[-1] + 1)   # current block
            rows = canvas.valid & ~st.done[:, None]
            p_idx, p_ok, _ = pack(rows & (blk[None] >= cached_blocks[:, None]) & (blk[None] < cur[:, None]))
            in_block = blk[None] == cur[:, None]
            q_idx, q_ok, _ = pack(rows & in_block)
            q_tok = st.tokens.gather(1, q_idx).masked_fill(st.masked.gather(1, q_idx), self.mask_id)
            logits = runner.run(p_idx, p_ok, q_idx, q_ok, q_tokens=q_tok, pend_group=blk[p_idx],
                                query_mask=q_ok[:, :, None] & q_ok[:, None, :],      # bidirectional block
                                logits_rows="all" if self.shift else "queries")
            runner.persist()
            if self.shift:
                logits, edge = block_rows(logits, p_idx.shape[1], p_idx, p_ok, q_idx, edge)
            cached_blocks = torch.maximum(cached_blocks, cur)
            x, conf = choose(logits, q_idx, st)
            act = q_ok & st.masked.gather(1, q_idx)
            before = (live & in_block).any(1) if st.criteria.enabled else None
            st.commit(q_idx, commit_mask(conf, act, cfg.tau, cfg.commit_k, self.rule), x, live, conf)
            st.end_step()
            if before is not None:
                done_block = _completed(st, before, in_block)
                if done_block.any():
                    st.check_stops((cur + 1) * cfg.block_size, rows=done_block)
        return st.output(runner.nfe, runner.evicted)


class MDLMSampler(_Base):
    @torch.no_grad()
    def generate(self, canvas: Canvas):
        cfg = self.cfg
        st, choose = self._start(canvas)
        B, N = st.tokens.shape
        dev = st.tokens.device
        start = first_true(canvas.generate)
        rel = (st.pos[None] - start[:, None]).clamp(min=0) // cfg.block_size      # block id in the region
        budget = context_budget(self.model, cfg)
        width = N if budget is None else min(N, int(budget))
        n_valid = canvas.valid.sum(1)
        j = torch.arange(width, device=dev)[None]
        view = None                      # (win, ok, vis): fixed when the canvas fits the context
        nfe = 0
        while True:
            live = st.live()
            if not live.any():
                break
            cur = rel.gather(1, first_true(live).clamp(max=N - 1)[:, None])[:, 0]
            in_block = rel == cur[:, None]
            active = live & in_block
            block_end = (start + (cur + 1) * cfg.block_size).clamp(max=n_valid)
            if view is None or width < N:
                hi = torch.minimum(n_valid, block_end.clamp(min=width))
                win = (hi - width).clamp(min=0)[:, None] + j                 # [B, width] canvas positions
                ok = win < n_valid[:, None]
                win = win.clamp(max=N - 1)
                eye = torch.eye(width, dtype=torch.bool, device=dev)[None]
                view = (win, ok, (ok[:, None, :] & ok[:, :, None]) | eye)
            win, ok, vis = view
            logits = self.model(st.tokens.gather(1, win).masked_fill(~ok, self.pad_id), win * ok, vis, 0)
            nfe += 1
            q_idx, q_ok, _ = pack(active)
            rel_q = (q_idx - win[:, :1]).clamp(min=0, max=width - 1)
            if self.shift:
                rel_q = view_rows(rel_q)
            x, conf = choose(logits.gather(1, rel_q[..., None].expand(*q_idx.shape, logits.shape[-1])), q_idx, st)
            before = active.any(1) if st.criteria.enabled else None
            st.commit(q_idx, commit_mask(conf, q_ok, cfg.tau, cfg.commit_k, self.rule), x, active, conf)
            st.end_step()
            if before is not None:
                done_block = _completed(st, before, in_block)
                if done_block.any():
                    st.check_stops(block_end, rows=done_block)
        return st.output(nfe)


__all__ = ["ARSampler", "BD3LMSampler", "MDLMSampler"]
