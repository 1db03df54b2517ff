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

from .base import Canvas, GenerationConfig, collect, finish_at_eos, first_true, pack
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
        tokens, masked = canvas.tokens.clone(), canvas.generate.clone()
        B, N = tokens.shape
        dev = tokens.device
        pos = torch.arange(N, device=dev)
        gen = torch.Generator(device=dev).manual_seed(cfg.seed)
        runner = ChunkRunner(self.model, tokens, self.mask_id, self.pad_id, cfg.use_cache, cfg.cache_capacity or N)
        first = first_true(masked)
        if bool((first == 0).any()):
            raise ValueError("AR decoding needs at least one visible token (e.g. BOS) before the first MASK")
        known = canvas.valid & (pos[None] < first[:, None])        # left context only
        done = ~masked.any(1)
        end = torch.full((B,), -1, dtype=torch.long, device=dev)
        steps = torch.zeros(B, dtype=torch.long, device=dev)
        committed = torch.zeros_like(steps)
        history, trace = [], []
        pend = known.clone()                                        # tokens whose K/V are not cached yet
        while True:
            live = masked & ~done[:, None]
            if not live.any():
                break
            src = pend if cfg.use_cache else known
            idx, ok, cnt = pack(src)
            logits, posi = runner.run(idx, ok, idx[:, :0], ok[:, :0], logits_rows="all")
            runner.persist(cnt, posi)
            last = (cnt - 1).clamp(min=0)
            x, _ = self._choose(logits.gather(1, last[:, None, None].expand(B, 1, logits.shape[-1]))[:, 0], gen)
            target = first_true(live)                               # next position to fill
            row = (~done) & (target < N)
            sel = torch.zeros(B, N, dtype=torch.bool, device=dev)
            sel[row, target[row]] = True
            tokens[sel] = x[row]
            masked &= ~sel
            known |= sel
            pend = sel
            n = sel.sum(1)
            committed += n
            steps += n
            history.append(n.tolist())
            if cfg.record:
                trace.append(tokens.clone())
            if cfg.stop_at_eos:
                newly, e, _ = finish_at_eos(tokens, masked, canvas.generate, canvas.infill, self.eos_id, done)
                end, done = torch.where(newly, e, end), done | newly
            done |= ~(masked.any(1))
        # infill rows: the span is filled left to right from the left context only
        return collect(canvas, tokens, masked, end, runner.nfe, steps, committed, history, trace)


class BD3LMSampler(_Base):
    @torch.no_grad()
    def generate(self, canvas: Canvas):
        cfg = self.cfg
        S = cfg.block_size
        tokens, masked = canvas.tokens.clone(), canvas.generate.clone()
        B, N = tokens.shape
        dev = tokens.device
        pos = torch.arange(N, device=dev)
        blk = pos // S
        gen = torch.Generator(device=dev).manual_seed(cfg.seed)
        runner = ChunkRunner(self.model, tokens, self.mask_id, self.pad_id, cfg.use_cache, cfg.cache_capacity or N)
        done = ~masked.any(1)
        end = torch.full((B,), -1, dtype=torch.long, device=dev)
        steps = torch.zeros(B, dtype=torch.long, device=dev)
        committed = torch.zeros_like(steps)
        history, trace = [], []
        cached_blocks = torch.zeros(B, dtype=torch.long, device=dev)     # blocks [0, cached) are in the cache
        while True:
            live = masked & ~done[:, None]
            if not live.any():
                break
            cur = torch.where(live.any(1), blk[first_true(live).clamp(max=N - 1)], blk[-1] + 1)   # current block
            lo = cached_blocks if cfg.use_cache else torch.zeros_like(cached_blocks)
            clean = canvas.valid & (blk[None] >= lo[:, None]) & (blk[None] < cur[:, None]) & ~done[:, None]
            p_idx, p_ok, p_cnt = pack(clean)
            noisy = canvas.valid & (blk[None] == cur[:, None]) & ~done[:, None]
            q_idx, q_ok, _ = pack(noisy)
            q_tok = tokens.gather(1, q_idx).masked_fill(masked.gather(1, q_idx), self.mask_id)
            pb = blk[p_idx]
            pending_mask = pb[:, None, :] <= pb[:, :, None]                   # block-causal among clean
            qm = q_ok[:, :, None] & q_ok[:, None, :]                          # bidirectional in the block
            logits, posi = runner.run(p_idx, p_ok, q_idx, q_ok, q_tokens=q_tok, pending_mask=pending_mask,
                                      query_mask=qm)
            runner.persist(p_cnt, posi)
            cached_blocks = torch.maximum(cached_blocks, cur) if cfg.use_cache else cached_blocks
            x, conf = self._choose(logits, gen)
            act = q_ok & masked.gather(1, q_idx)
            cm = commit_mask(conf, act, cfg.tau, cfg.commit_k)
            sel = torch.zeros(B, N, dtype=torch.bool, device=dev).scatter_(1, q_idx, cm) & live
            vals = torch.zeros(B, N, dtype=torch.long, device=dev).scatter_(1, q_idx, torch.where(cm, x, 0))
            tokens[sel] = vals[sel]
            masked &= ~sel
            n = sel.sum(1)
            committed += n
            steps += (n > 0).long()
            history.append(n.tolist())
            if cfg.record:
                trace.append(tokens.clone())
            if cfg.stop_at_eos:
                newly, e, _ = finish_at_eos(tokens, masked, canvas.generate, canvas.infill, self.eos_id, done)
                end, done = torch.where(newly, e, end), done | newly
            done |= ~(masked.any(1))
        return collect(canvas, tokens, masked, end, runner.nfe, steps, committed, history, trace)


class MDLMSampler(_Base):
    @torch.no_grad()
    def generate(self, canvas: Canvas):
        cfg = self.cfg
        tokens, masked = canvas.tokens.clone(), canvas.generate.clone()
        B, N = tokens.shape
        dev = tokens.device
        pos = torch.arange(N, device=dev)
        gen = torch.Generator(device=dev).manual_seed(cfg.seed)
        start = first_true(canvas.generate)
        rel = (pos[None] - start[:, None]).clamp(min=0) // cfg.block_size       # block id in the region
        full = canvas.valid[:, None, :] & canvas.valid[:, :, None]
        full |= torch.eye(N, dtype=torch.bool, device=dev)[None]
        posn = pos.expand(B, N)
        done = ~masked.any(1)
        end = torch.full((B,), -1, dtype=torch.long, device=dev)
        steps = torch.zeros(B, dtype=torch.long, device=dev)
        committed = torch.zeros_like(steps)
        history, trace, nfe = [], [], 0
        while True:
            live = masked & ~done[:, None]
            if not live.any():
                break
            cur = rel.gather(1, first_true(live).clamp(max=N - 1)[:, None])[:, 0]
            active = live & (rel == cur[:, None])
            logits = self.model(tokens.masked_fill(~canvas.valid, self.pad_id), posn, full, 0)
            nfe += 1
            q_idx, q_ok, _ = pack(active)
            x, conf = self._choose(logits.gather(1, q_idx[..., None].expand(*q_idx.shape, logits.shape[-1])), gen)
            cm = commit_mask(conf, q_ok, cfg.tau, cfg.commit_k)
            sel = torch.zeros(B, N, dtype=torch.bool, device=dev).scatter_(1, q_idx, cm) & active
            vals = torch.zeros(B, N, dtype=torch.long, device=dev).scatter_(1, q_idx, torch.where(cm, x, 0))
            tokens[sel] = vals[sel]
            masked &= ~sel
            n = sel.sum(1)
            committed += n
            steps += (n > 0).long()
            history.append(n.tolist())
            if cfg.record:
                trace.append(tokens.clone())
            if cfg.stop_at_eos:
                newly, e, _ = finish_at_eos(tokens, masked, canvas.generate, canvas.infill, self.eos_id, done)
                end, done = torch.where(newly, e, end), done | newly
            done |= ~(masked.any(1))
        return collect(canvas, tokens, masked, end, nfe, steps, committed, history, trace)


__all__ = ["ARSampler", "BD3LMSampler", "MDLMSampler"]
