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

Each sampler's decode is a session (:mod:`.session`, :mod:`.calls`: a state machine of steps, ``next_calls`` /
``advance``) over rows that requests may join (``admit``) and leave (``retire``) between steps; every row's
bookkeeping is batched, and rows without work are left out of the forward. ``generate`` drives a session whose
rows all join before the first step.

AR and BD3LM keep cache + chunk <= L like SetDLM (:mod:`.context`); ``use_cache=False`` gives their
uncached reference (the whole history recomputed with the visibility the cache implies). A model with
``shift_logits`` (method.md 13) is read with the AR shift of its training objective (:mod:`.shift`); AR
decoding is shifted by nature and unchanged.
"""
from __future__ import annotations

import torch

from .base import DecodeState, first_true, pack
from .calls import Call
from .sampling import commit_mask
from .session import Sampler, Session
from .shift import block_rows, view_rows


class _Base(Sampler):
    """The baselines' sampler: a :class:`~.session.Sampler` that has no window to draft with."""

    def _refuse(self) -> None:
        if self.cfg.speculative:
            raise ValueError(f"speculative decoding drafts with a SetDLM's window; {type(self).__name__} has none: "
                             f"decode without speculative")


class ARSession(Session):
    """AR decoding: each step feeds every row's pending tokens (its prompt when it joins, else its last token)
    and commits the next position from the last pending row's logits."""

    def __init__(self, sampler, canvas):
        super().__init__(sampler, canvas)
        self.pend = self._left(slice(None))

    def _left(self, rows) -> torch.Tensor:
        """The left context of ``rows`` (also for infill: AR cannot see the right side), their first pending."""
        st = self.st
        first = first_true(st.masked[rows])
        if bool((first == 0).any()):
            raise ValueError("AR decoding needs at least one visible token (e.g. BOS) before the first MASK")
        return self.canvas.valid[rows] & (st.pos[None] < first[:, None])

    def _reset(self, b: int) -> None:
        self.pend[b] = self._left(slice(b, b + 1))[0]

    def retire(self, b: int) -> None:
        super().retire(b)
        self.pend[b] = False

    def _step(self):
        st, runner = self.st, self.runner
        live = st.live()
        if not bool(live.any()):
            return False
        B, N = st.tokens.shape
        idx, ok, cnt = pack(self.pend)
        logits = yield from runner.run(idx, ok, idx[:, :0], ok[:, :0], logits_rows="all")
        runner.persist()
        last = (cnt - 1).clamp(min=0)
        target = first_true(live).clamp(max=N - 1)                 # the next position to fill
        busy = live.any(1)
        x, conf = self.choose(logits.gather(1, last[:, None, None].expand(B, 1, logits.shape[-1])), target[:, None],
                              st, busy[:, None])
        self.pend = st.commit(target[:, None], busy[:, None], x, live, conf, expect=busy)
        st.end_step()
        if st.criteria.enabled:
            st.check_stops(first_true(st.masked))
        return True


def _completed(st: DecodeState, before: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Rows whose ``block`` [B, N] region had masked positions ``before`` and has none now."""
    return before & ~(st.masked & block).any(1) & ~st.done


class BD3LMSession(Session):
    """Block diffusion: every row's current block against the cache, its completed blocks written in the next
    forward (module docstring)."""

    def __init__(self, sampler, canvas):
        super().__init__(sampler, canvas)
        st = self.st
        self.blk = st.pos // self.cfg.block_size
        self.cached_blocks = torch.zeros(st.tokens.shape[0], dtype=torch.long, device=st.tokens.device)
        self.edge = None                 # shift_logits: the clean row of the current block's predecessor

    def _reset(self, b: int) -> None:
        self.cached_blocks[b] = 0
        if self.edge is not None:
            self.edge[b] = 0

    def _step(self):
        cfg, st, runner, blk = self.cfg, self.st, self.runner, self.blk
        live = st.live()
        if not bool(live.any()):
            return False
        N = st.tokens.shape[1]
        cur = torch.where(live.any(1), blk[first_true(live).clamp(max=N - 1)], blk[-1] + 1)   # current block
        rows = self.canvas.valid & ~st.done[:, None]
        p_idx, p_ok, _ = pack(rows & (blk[None] >= self.cached_blocks[:, None]) & (blk[None] < cur[:, None]))
        in_block = blk[None] == cur[:, None]
        q_idx, q_ok, _ = pack(rows & in_block)
        q_tok = st.tokens.gather(1, q_idx).masked_fill(st.masked.gather(1, q_idx), self.sampler.mask_id)
        shift = self.sampler.shift
        logits = yield from runner.run(p_idx, p_ok, q_idx, q_ok, q_tokens=q_tok, pend_group=blk[p_idx],
                                       query_mask=q_ok[:, :, None] & q_ok[:, None, :],      # bidirectional block
                                       logits_rows="all" if shift else "queries")
        runner.persist()
        if shift:
            logits, self.edge = block_rows(logits, p_idx.shape[1], p_idx, p_ok, q_idx, self.edge)
        self.cached_blocks = torch.maximum(self.cached_blocks, cur)
        x, conf = self.choose(logits, q_idx, st, q_ok)
        act = q_ok & st.masked.gather(1, q_idx)
        before = (live & in_block).any(1) if st.criteria.enabled else None
        st.commit(q_idx, commit_mask(conf, act, cfg.tau, cfg.commit_k, self.rule), x, live, conf,
                  expect=live.any(1))
        st.end_step()
        if before is not None:
            done_block = _completed(st, before, in_block)
            if done_block.any():
                st.check_stops((cur + 1) * cfg.block_size, rows=done_block)
        return True


class MDLMSession(Session):
    """Masked diffusion: every live row's view of the canvas recomputed each step (no cache); rows without work
    are left out of the forward."""

    cached = False

    def __init__(self, sampler, canvas):
        super().__init__(sampler, canvas)
        st = self.st
        N = st.tokens.shape[1]
        self.width = N if self.budget is None else min(N, int(self.budget))
        self.start = first_true(canvas.generate)
        self.rel = (st.pos[None] - self.start[:, None]).clamp(min=0) // self.cfg.block_size   # block id in region
        self.n_valid = canvas.valid.sum(1)
        self.view = None                 # (win, ok, vis): fixed while the canvas fits the context

    def _reset(self, b: int) -> None:
        st, cv = self.st, self.canvas
        self.start[b] = first_true(cv.generate[b:b + 1])[0]
        self.rel[b] = (st.pos - self.start[b]).clamp(min=0) // self.cfg.block_size
        self.n_valid[b] = cv.valid[b].sum()
        self.view = None

    def _views(self, block_end):
        width, N, dev = self.width, self.st.tokens.shape[1], self.st.tokens.device
        if self.view is None or width < N:
            hi = torch.minimum(self.n_valid, block_end.clamp(min=width))
            win = (hi - width).clamp(min=0)[:, None] + torch.arange(width, device=dev)[None]   # canvas positions
            ok = win < self.n_valid[:, None]
            win = win.clamp(max=N - 1)
            eye = torch.eye(width, dtype=torch.bool, device=dev)[None]
            self.view = (win, ok, (ok[:, None, :] & ok[:, :, None]) | eye)
        return self.view

    def _step(self):
        cfg, st, s = self.cfg, self.st, self.sampler
        live = st.live()
        busy = live.any(1)
        if not bool(busy.any()):
            return False
        N = st.tokens.shape[1]
        cur = self.rel.gather(1, first_true(live).clamp(max=N - 1)[:, None])[:, 0]
        in_block = self.rel == cur[:, None]
        active = live & in_block
        block_end = (self.start + (cur + 1) * cfg.block_size).clamp(max=self.n_valid)
        win, ok, vis = self._views(block_end)
        tok = st.tokens.gather(1, win).masked_fill(~ok, s.pad_id)
        self.nfe += 1
        if bool(busy.all()):
            logits = yield Call(tok, win * ok, vis, 0)
        else:                            # only the rows with work (a session's free or finished slots skip)
            idx = busy.nonzero()[:, 0]
            part = yield Call(tok[idx], (win * ok)[idx], vis[idx], 0)
            logits = part.new_zeros(st.tokens.shape[0], *part.shape[1:])
            logits[idx] = part
        q_idx, q_ok, _ = pack(active)
        rel_q = (q_idx - win[:, :1]).clamp(min=0, max=self.width - 1)
        if s.shift:
            rel_q = view_rows(rel_q)
        x, conf = self.choose(logits.gather(1, rel_q[..., None].expand(*q_idx.shape, logits.shape[-1])), q_idx, st,
                              q_ok)
        before = active.any(1) if st.criteria.enabled else None
        st.commit(q_idx, commit_mask(conf, q_ok, cfg.tau, cfg.commit_k, self.rule), x, active, conf, expect=busy)
        st.end_step()
        if before is not None:
            done_block = _completed(st, before, in_block)
            if done_block.any():
                st.check_stops(block_end, rows=done_block)
        return True


class ARSampler(_Base):
    session_class = ARSession


class BD3LMSampler(_Base):
    session_class = BD3LMSession


class MDLMSampler(_Base):
    session_class = MDLMSession


__all__ = ["ARSampler", "BD3LMSampler", "MDLMSampler", "ARSession", "BD3LMSession", "MDLMSession"]
