"""The SetDLM sampler: sliding-window sets with a KV-cache commit after every step (method.md 5).

Per step i, for every row with masked positions left:

    f       = leftmost masked position
    active  = masked positions in [f, f + W)                       (a positional window, P10)
    chunk   = [pending: tokens committed at step i-1 ; active: MASK at each active position]
    crop    = evict cache entries so that cache + chunk <= L       (oldest first; 5.2, P15)
    mask    = pending row a: cache + pending rows 0..a             (causal among new commits)
              active row:    cache + all pending + itself          (never another MASK, P13)
    logits  = model(chunk, absolute positions, mask) on the active rows, then the processors
    persist the pending rows' K/V (the deferred, fused cache write, P12); drop the active rows' K/V
    commit  = top-k confident active positions U {confidence >= tau}   (P11)
    after step i > 0 with i % W == 0: stopping criteria on [0, f_new + W)   (P14)

Pending order: ascending position, or with ``fht_cache_order`` (plain prompts, method.md 4.6)
descending first-hitting time, the times sampled once per row for its generated positions from the
checkpoint's order prior with S_max = 2W (seeded by the seed and the prompt, so a row decodes the same
in any batch); eviction then drops the smallest positions first. Visibility stays insertion-based: every
cached token is visible to every later query (the reference's P16 bug is not copied).

Prefill: every visible token (the prompt; for infilling the prefix AND the suffix, or with
``infill_full_context=False`` the prefix only, the suffix then joining the cache, in position order,
once a committed token lies to its right: the reference's ``l2r`` promotion) in position order,
causally. The last step's commits are never cached. ``use_cache=False`` recomputes the whole history
each step with the visibility the cache would have (:mod:`.runner`): tests use it to prove the cache
changes nothing. Rows of a batch commit different numbers of tokens per step; all bookkeeping is
batched tensors (:func:`~setdiff_mega.decoding.base.pack`).

A model with ``shift_logits`` (the AR head alignment, method.md 13) gets logits on the pending rows too: a
masked position whose left neighbour is committed reads that neighbour's clean row (:mod:`.shift`).
``speculative=True`` decodes with :class:`SpeculativeSession` (this session with the step of :mod:`.speculative`;
method.md 16).
"""
from __future__ import annotations

import zlib

import torch

from .base import Canvas, GenerationConfig, first_true, pack
from .runner import ChunkRunner
from .sampling import commit_mask
from .session import Sampler, Session, context_budget
from .shift import PredecessorRows
from .speculative import SpeculativeStep, check_model


def row_seed(seed: int, canvas: Canvas, b: int) -> int:
    """A per-request seed from the seed and the request's visible tokens (independent of the batch)."""
    given = canvas.tokens[b][canvas.valid[b] & ~canvas.generate[b]].to(torch.int64).cpu().numpy().tobytes()
    return (int(seed) * 1_000_003 + zlib.crc32(given)) % (2 ** 63)


def first_hitting_times(canvas: Canvas, cfg: GenerationConfig, L: int, prior) -> torch.Tensor:
    """[B, N] float64: the order prior's first-hitting times of each plain row's generated positions (-inf
    elsewhere), from the checkpoint's prior with S_max = 2W (``prior.decode_order_times``; method.md 4.6)."""
    if not hasattr(prior, "decode_order_times"):
        raise ValueError("fht_cache_order needs the checkpoint's SetDLM order prior (its D, k, b); it is not "
                         "available here: decode without fht_cache_order")
    B, N = canvas.tokens.shape
    out = torch.full((B, N), float("-inf"), dtype=torch.float64, device=canvas.tokens.device)
    for b in range(B):                                   # once per request, before decoding
        if bool(canvas.infill[b]):
            continue
        g = torch.Generator().manual_seed(row_seed(cfg.seed, canvas, b))
        sel = canvas.generate[b]
        try:
            t = prior.decode_order_times(L, 2 * cfg.window, int(sel.sum()), generator=g)
        except ValueError as e:
            raise ValueError(f"fht_cache_order: the order prior with S_max = 2W = {2 * cfg.window} is invalid "
                             f"({e}); choose a window W with D/2 <= W <= L/2") from None
        out[b, sel] = t.to(out.device)
    return out


class SetDLMSampler(Sampler):
    """Decode a :class:`Canvas` with sliding-window sets (see the module docstring): a :class:`~.session.Sampler`
    whose sessions are :class:`SetDLMSession` (with ``speculative``, :class:`SpeculativeSession`).

    ``order_prior`` (the checkpoint's SetDLM objective: D, k, b) is needed for ``fht_cache_order``.
    """

    def _refuse(self) -> None:
        if self.cfg.speculative:       # self-speculation (method.md 16): refused at once on a checkpoint without it
            check_model(self.model)

    @property
    def session_class(self) -> type:
        return SpeculativeSession if self.cfg.speculative else SetDLMSession


class SetDLMSession(Session):
    """One batched SetDLM decode, step by step (the module docstring's loop), over rows that requests may join
    and leave between steps: :meth:`admit` rewrites a finished row of the canvas with a new request and resets
    that row's state (decode state, stopping counters, ledger, KV-cache window, FHT times, kept predecessor
    rows) without touching the others. A row's first step after it joined is its prefill (its visible tokens
    as pending, no queries), fused with the other rows' decode steps; its stopping criteria follow its own
    step count. The session is a decode state (:mod:`.calls`: ``next_calls`` / ``advance``);
    :meth:`SetDLMSampler.generate` drives a session whose rows all join before the first step, so both give the
    same tokens per row."""

    fht: torch.Tensor | None           # [B, N] float64 first-hitting times (fht_cache_order), else None

    def __init__(self, sampler: SetDLMSampler, canvas: Canvas):
        super().__init__(sampler, canvas)
        st = self.st
        self.shifted = PredecessorRows() if sampler.shift else None
        self.rows = "queries" if self.shifted is None else "all"
        B, N = st.tokens.shape
        self.prefill = torch.zeros(B, N, dtype=torch.bool, device=st.tokens.device)
        self.waiting = torch.zeros_like(self.prefill)   # prefix-only infill: the suffix, not cached yet
        self.pending = torch.zeros_like(self.prefill)   # committed at the last step, cached at the next
        self.row_step = torch.zeros(B, dtype=torch.long, device=st.tokens.device)
        self._joining = self._waiting = False            # host-side: any row prefilling / with uncached suffix
        self._prefill_rows(torch.ones(B, dtype=torch.bool, device=st.tokens.device))

    @property
    def anchored(self) -> bool:
        """The commit rule "auto" is the leftmost tokens for a model read with the AR head shift (method.md 15)."""
        return self.sampler.shift

    def _runner(self) -> ChunkRunner:
        """The runner, its cache written in ascending position or (``fht_cache_order``) descending first-hitting
        time (the times drawn here, per request: ``fht``)."""
        s, cfg, canvas = self.sampler, self.cfg, self.canvas
        self.fht = None
        if cfg.fht_cache_order:
            if s.order_prior is None or self.budget is None:
                raise ValueError("fht_cache_order needs the checkpoint's order prior (D) and training length; "
                                 "decode through setdiff_mega.inference.generate with the checkpoint's objective")
            self.fht = first_hitting_times(canvas, cfg, self.budget, s.order_prior)
        by_pos = None if self.fht is None else ~canvas.infill
        static = (cfg.window, cfg.window) if cfg.static_shapes else None    # pending <= W commits, W queries
        return ChunkRunner(s.model, self.st.tokens, s.mask_id, s.pad_id, cfg.use_cache, self.budget, by_pos,
                           static_chunk=static)

    def _order(self, sel: torch.Tensor):
        """Pending tokens packed in cache-write order: ascending position, or descending FHT."""
        idx, ok, _ = pack(sel)
        fht = self.fht
        if fht is None or idx.shape[1] == 0:
            return idx, ok
        key = torch.where(torch.isfinite(fht.gather(1, idx)), -fht.gather(1, idx), idx.to(torch.float64))
        order = torch.where(ok, key, torch.full_like(key, float("inf"))).sort(dim=1, stable=True).indices
        return idx.gather(1, order), ok.gather(1, order)

    def _prefill_rows(self, rows: torch.Tensor) -> None:
        st, cv = self.st, self.canvas
        visible = cv.valid & ~st.masked & rows[:, None]
        prefill = visible if self.cfg.infill_full_context else \
            visible & (st.pos[None] < first_true(st.masked)[:, None])
        self.prefill |= prefill
        self.waiting |= visible & ~prefill
        self._joining |= bool(prefill.any())
        self._waiting |= bool(self.waiting.any())

    def _reset(self, b: int) -> None:
        """Row ``b`` joined: its FHT times, kept predecessor rows, prefill / pending state and step count start
        again (the class docstring)."""
        cv = self.canvas
        if self.fht is not None:
            n = int(cv.valid[b].sum())                   # the request's positions (Canvas.put_row)
            self.fht[b] = float("-inf")
            row = Canvas(cv.tokens[b:b + 1, :n], cv.generate[b:b + 1, :n], cv.valid[b:b + 1, :n], cv.infill[b:b + 1])
            self.fht[b, :n] = first_hitting_times(row, self.cfg, self.budget, self.sampler.order_prior)[0]
            self.runner.ledger.by_position[b] = not bool(cv.infill[b])
        if self.shifted is not None:
            self.shifted.reset_row(b)
        for t in (self.prefill, self.waiting, self.pending):
            t[b] = False
        self.row_step[b] = 0
        self._prefill_rows(torch.arange(cv.tokens.shape[0], device=cv.tokens.device) == b)

    def retire(self, b: int) -> None:
        super().retire(b)
        for t in (self.prefill, self.waiting, self.pending):
            t[b] = False

    def _pending(self):
        """The step's pending tokens: the rows' last commits in cache-write order, or a joining row's prefill."""
        pend_idx, pend_ok = self._order(self.pending)
        rows = self.prefill.any(1) if self._joining else None
        if rows is None or not bool(rows.any()):          # (a joining row may have been retired unstepped)
            self._joining = False
            return pend_idx, pend_ok, None
        pre_idx, pre_ok, _ = pack(self.prefill)
        M = max(pend_idx.shape[1], pre_idx.shape[1])
        pad = lambda t, v: torch.cat([t, t.new_full((t.shape[0], M - t.shape[1]), v)], 1)   # noqa: E731
        idx = torch.where(rows[:, None], pad(pre_idx, 0), pad(pend_idx, 0))
        ok = torch.where(rows[:, None], pad(pre_ok, False), pad(pend_ok, False))
        return idx, ok, rows

    @torch.no_grad()
    def _step(self):
        """One forward for every live row (a joining row: its prefill), as a generator (:class:`~.calls.Stepper`);
        returns False when no row has work left."""
        st, cfg, runner = self.st, self.cfg, self.runner
        pend_idx, pend_ok, joining = self._pending()
        if joining is None:
            live = st.live()
            if not bool(live.any()):
                return False                             # the last step's commits are never cached
        else:
            live = st.live() & ~joining[:, None]
        f = first_true(live)
        active = live & (st.pos[None] < (f + cfg.window)[:, None])
        q_idx, q_ok, _ = pack(active)
        logits = yield from runner.run(pend_idx, pend_ok, q_idx, q_ok, logits_rows=self.rows)
        runner.persist()
        if joining is not None:                          # every joining row ran its prefill
            self.prefill.zero_()
            self._joining = False
        self.pending.zero_()
        if self.shifted is not None:
            P = pend_idx.shape[1]
            self.shifted.add(pend_idx, pend_ok, logits[:, :P], st.masked)
            logits = self.shifted.lookup(q_idx, logits[:, P:])
        if q_idx.shape[1] == 0:                          # prefills only: nothing to commit
            return True
        x, conf = self.choose(logits, q_idx, st, q_ok)
        sel = st.commit(q_idx, commit_mask(conf, q_ok, cfg.tau, cfg.commit_k, self.rule), x, active, conf,
                        expect=live.any(1))
        if self._waiting:                                # l2r promotion of uncached context
            reach = torch.where(sel, st.pos[None], torch.full_like(st.pos[None], -1)).max(1).values
            promote = self.waiting & (st.pos[None] <= reach[:, None])
            self.waiting &= ~promote
            sel = sel | promote
            self._waiting = bool(self.waiting.any())
        self.pending |= sel
        st.end_step()
        stepped = live.any(1)
        if st.criteria.enabled:
            due = stepped & (self.row_step > 0) & (self.row_step % cfg.window == 0)
            if bool(due.any()):
                st.check_stops(first_true(st.masked) + cfg.window, rows=due)
        self.row_step += stepped.long()
        return True


class SpeculativeSession(SpeculativeStep, SetDLMSession):
    """Self-speculative decoding (method.md 16): a SetDLM session whose step verifies the last drafts with the AR head
    and drafts the next window (:class:`~.speculative.SpeculativeStep`)."""


__all__ = ["SetDLMSampler", "SetDLMSession", "SpeculativeSession", "context_budget", "first_hitting_times",
           "row_seed"]
