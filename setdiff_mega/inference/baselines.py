"""Baseline samplers with the same interface as the SetDLM sampler.

* :class:`ARSampler` (next-token model, KV cache): prefill the prompt causally; each step feeds the
  last committed token, persists its K/V and reads the next token from its logits. One token per step.
  Infill requests keep only the left context (AR cannot see the right side) and fill the span.
* :class:`BD3LMSampler` (block diffusion, KV cache per block): blocks of S positions aligned to
  absolute positions. Inside the current block the noisy tokens attend the cache (clean earlier
  blocks) and every token of their own block; each step commits the top-k + tau set of the block's
  masked positions. When a block is complete its clean tokens are written to the cache in the next
  forward, fused with the next block's first prediction: chunk = [clean block ; noisy next block],
  clean rows see cache + their block (bidirectional within the block, as in training).
* :class:`MDLMSampler` (masked diffusion, no cache): a fixed canvas, full bidirectional recompute each
  step, semi-autoregressive blocks of ``block_size`` positions from the start of the generation region,
  top-k + tau commits inside the current block (committed tokens are never changed: SUBS).

``use_cache=False`` gives the uncached reference for AR and BD3LM (full recompute over all clean
tokens each step, same attention pattern).
"""
from __future__ import annotations

import torch

from .base import Canvas, DecodeState, GenerationConfig, first_true, pack
from .sampling import choose_tokens, commit_mask
from .setdlm import ChunkRunner


class _Base:
    def __init__(self, model, mask_id: int, pad_id: int, eos_id: int, config: GenerationConfig, tokenizer=None):
        self.model, self.mask_id, self.pad_id, self.eos_id = model, mask_id, pad_id, eos_id
        self.cfg = config.validate()
        self.tokenizer = tokenizer

    def _choose(self, logits, gen):
        return choose_tokens(logits, [self.mask_id, self.pad_id], self.cfg.temperature, self.cfg.top_p, gen)


class ARSampler(_Base):
    @torch.no_grad()
    def generate(self, canvas: Canvas):
        cfg = self.cfg
        st = DecodeState(canvas, cfg, self.eos_id)
        B, N = st.tokens.shape
        runner = ChunkRunner(self.model, st.tokens, self.mask_id, self.pad_id, cfg.use_cache, cfg.cache_capacity or N)
        first = first_true(st.masked)
        if bool((first == 0).any()):
            raise ValueError("AR decoding needs at least one visible token (e.g. BOS) before the first MASK")
        known = canvas.valid & (st.pos[None] < first[:, None])        # left context only (also for infill)
        pend = known.clone()                                            # tokens whose K/V are not cached yet
        while True:
            live = st.live()
            if not live.any():
                break
            idx, ok, cnt = pack(pend if cfg.use_cache else known)
            logits, posi = runner.run(idx, ok, idx[:, :0], ok[:, :0], logits_rows="all")
            runner.persist(cnt, posi)
            last = (cnt - 1).clamp(min=0)
            x, _ = self._choose(logits.gather(1, last[:, None, None].expand(B, 1, logits.shape[-1])), st.generator)
            target = first_true(live).clamp(max=N - 1)                 # the next position to fill
            sel = st.commit(target[:, None], (~st.done)[:, None], x, live)
            known |= sel
            pend = sel
            st.end_step()
        return st.output(runner.nfe)


class BD3LMSampler(_Base):
    @torch.no_grad()
    def generate(self, canvas: Canvas):
        cfg = self.cfg
        st = DecodeState(canvas, cfg, self.eos_id)
        B, N = st.tokens.shape
        blk = st.pos // cfg.block_size
        runner = ChunkRunner(self.model, st.tokens, self.mask_id, self.pad_id, cfg.use_cache, cfg.cache_capacity or N)
        cached_blocks = torch.zeros(B, dtype=torch.long, device=st.tokens.device)   # blocks [0, n) are cached
        while True:
            live = st.live()
            if not live.any():
                break
            cur = torch.where(live.any(1), blk[first_true(live).clamp(max=N - 1)], blk[-1] + 1)   # current block
            lo = cached_blocks if cfg.use_cache else torch.zeros_like(cached_blocks)
            rows = canvas.valid & ~st.done[:, None]
            p_idx, p_ok, p_cnt = pack(rows & (blk[None] >= lo[:, None]) & (blk[None] < cur[:, None]))
            q_idx, q_ok, _ = pack(rows & (blk[None] == cur[:, None]))
            q_tok = st.tokens.gather(1, q_idx).masked_fill(st.masked.gather(1, q_idx), self.mask_id)
            pb = blk[p_idx]
            logits, posi = runner.run(p_idx, p_ok, q_idx, q_ok, q_tokens=q_tok,
                                      pending_mask=pb[:, None, :] <= pb[:, :, None],      # block-causal clean
                                      query_mask=q_ok[:, :, None] & q_ok[:, None, :])      # bidirectional block
            runner.persist(p_cnt, posi)
            if cfg.use_cache:
                cached_blocks = torch.maximum(cached_blocks, cur)
            x, conf = self._choose(logits, st.generator)
            act = q_ok & st.masked.gather(1, q_idx)
            st.commit(q_idx, commit_mask(conf, act, cfg.tau, cfg.commit_k), x, live)
            st.end_step()
        return st.output(runner.nfe)


class MDLMSampler(_Base):
    @torch.no_grad()
    def generate(self, canvas: Canvas):
        cfg = self.cfg
        st = DecodeState(canvas, cfg, self.eos_id)
        B, N = st.tokens.shape
        start = first_true(canvas.generate)
        rel = (st.pos[None] - start[:, None]).clamp(min=0) // cfg.block_size      # block id in the region
        full = (canvas.valid[:, None, :] & canvas.valid[:, :, None]) | torch.eye(N, dtype=torch.bool,
                                                                                 device=st.tokens.device)[None]
        posn = st.pos.expand(B, N)
        nfe = 0
        while True:
            live = st.live()
            if not live.any():
                break
            cur = rel.gather(1, first_true(live).clamp(max=N - 1)[:, None])[:, 0]
            active = live & (rel == cur[:, None])
            logits = self.model(st.tokens.masked_fill(~canvas.valid, self.pad_id), posn, full, 0)
            nfe += 1
            q_idx, q_ok, _ = pack(active)
            x, conf = self._choose(logits.gather(1, q_idx[..., None].expand(*q_idx.shape, logits.shape[-1])),
                                   st.generator)
            st.commit(q_idx, commit_mask(conf, q_ok, cfg.tau, cfg.commit_k), x, active)
            st.end_step()
        return st.output(nfe)


__all__ = ["ARSampler", "BD3LMSampler", "MDLMSampler"]
