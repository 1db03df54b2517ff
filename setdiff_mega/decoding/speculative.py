"""Self-speculative decoding of a SetDLM (method.md 16, issue 59): the model's own greedy left-to-right answer, several
tokens per forward, drafted by the set sampler and verified by the same network's next-token head in the same
forward.

A SetDLM trained with the AR head shift (``model.shift_logits``) and the next-token loss (``objective.ar_weight``
> 0) holds two predictors: the clean row of position p - 1 predicts p (its AR mode: SetDLM at W = 1, :mod:`.shift`)
and the MASK rows of a window predict their positions from the committed tokens alone (the set sampler). Per row the
decode keeps ``e`` (the last exact token, committed, not cached yet) and the drafts d_1..d_m after it; one forward
over the chunk

    [e, d_1, .., d_m  (pending: clean, causal) ; MASK at the next W positions (queries)]

gives, with the shift's reading rule (:class:`~.shift.PredecessorRows`), y_i = argmax of the row d_i's position
reads (the clean row of e or d_{i-1}: the AR head on exactly the tokens before it) and the queries' tokens:

    j       = the longest prefix with d_i == y_i                 (accepted drafts)
    j < m:  commit d_1..d_j and the correction y_{j+1}; the queries saw a rejected draft: dropped
    j == m: commit d_1..d_m and the first query's token (it reads d_m's clean row: exact, the "bonus");
            the other queries' argmaxes (their own MASK rows) are the next drafts
    cache   e, d_1..d_j (the accepted run leads the chunk: ``ChunkRunner.persist(keep)``); rejected drafts' K/V and
            kept clean rows are dropped

so every committed token is the AR head's argmax on the tokens before it: the output is AR mode's (SetDLM with
W = 1, greedy), token for token up to float rounding, with j + 1 tokens per forward (at most W). One forward per
step wherever the layout allows: always, since the queries see the drafts as committed context (when a draft is
rejected the step's drafts are lost and the next forward drafts from the correction: no second forward, one wasted
set of queries). Rows accept different lengths (all bookkeeping is per row; the cache commits per-row counts).

Exactly as AR mode also in its stops and context: EOS ends a row at its first eligible EOS, and the stopping
criteria are evaluated after every committed token on the canvas AR mode had then (tokens after it still MASK),
at AR mode's cadence (after every step but the first); near the context budget a row's chunk shrinks (fewer
queries, then fewer drafts) so that nothing is evicted before AR mode would evict, down to AR mode's own chunk
(the exact token and one query), which evicts as AR mode does. Rows with a temperature sample their drafts and
verify them with the speculative-sampling rejection rule (:meth:`SpeculativeStep._sample`): their tokens are
distributed as AR mode's samples. Options that would make a draft's verification depend on the drafts before it
(repetition / length penalty) or reorder the cache are refused by :meth:`GenerationConfig.validate`. A checkpoint
without the head shift or the next-token loss is refused by :func:`check_model` (its record's ``self_speculative``).
"""
from __future__ import annotations

import torch

from .base import finish_at_eos, first_true, pack
from .sampling import top_p_filter


def check_model(model) -> None:
    """Refuse (one line) a checkpoint whose record does not say it can verify its own drafts."""
    missing = [what for what, ok in (("the AR head shift (model.shift_logits=true)", getattr(model, "shift_logits",
                                                                                           False)),
                                     ("the next-token loss (objective.ar_weight > 0)",
                                      getattr(model, "self_speculative", False))) if not ok]
    if missing:
        raise ValueError(f"speculative decoding needs a SetDLM trained with {' and '.join(missing)} (e.g. "
                         f"configs/tiny_cpu_spec.yaml); this checkpoint lacks it: decode without speculative")


class SpeculativeStep:
    """The step of a SetDLM session (cache, ledger, kept clean rows, processors, joins and leaves) that verifies and
    drafts (module docstring): mixed into :class:`~.setdlm.SpeculativeSession` before the SetDLM session. ``draft``
    [B, N]: positions holding an unverified draft (its token in ``view``, which the runner reads; the decode state's
    canvas holds only accepted tokens)."""

    def __init__(self, sampler, canvas):
        super().__init__(sampler, canvas)
        st = self.st
        self.view = st.tokens.clone()            # accepted tokens + drafts: what the chunk's pending rows hold
        self.runner.tokens = self.view
        self.draft = torch.zeros_like(self.pending)
        self.budget = self.runner.ledger.budget
        W = self.cfg.window
        self.verified = torch.zeros(W, dtype=torch.long, device=st.tokens.device)   # per window index k >= 1
        self.accepted = torch.zeros(W, dtype=torch.long, device=st.tokens.device)
        self.log = [[] for _ in range(st.tokens.shape[0])] if self.cfg.record else None
        self.q = [None] * st.tokens.shape[0]     # sampled rows: each draft's distribution q [m, V], in draft order

    def admit(self, b: int, ids: list[int], max_new_tokens: int, seed: int | None = None, options=None) -> None:
        if options is not None and options.repetition_penalty != 1.0:
            raise ValueError("speculative decoding does not combine with a repetition penalty")
        super().admit(b, ids, max_new_tokens, seed, options)
        self.draft[b] = False
        self.q[b] = None
        self.view[b] = self.st.tokens[b]
        if self.log is not None:
            self.log[b] = []

    def retire(self, b: int) -> None:
        super().retire(b)
        self.draft[b] = False

    def output(self, rows: slice = slice(None)):
        out = super().output(rows)
        out.speculation = {"verified": self.verified.tolist(), "accepted": self.accepted.tolist()}
        if self.log is not None:
            out.speculation["drafts"] = self.log[rows]
        return out

    def _fit(self, pend_idx, pend_ok, joining):
        """Per row (not joining) the chunk's widths under the context budget (module docstring): [B] queries, and
        the pending entries cut to the drafts that still fit (the cut ones are forgotten)."""
        W = self.cfg.window
        width = torch.full((pend_idx.shape[0],), W, dtype=torch.long, device=pend_idx.device)
        ledger = self.runner.ledger
        if self.budget is None or ledger._bound + pend_idx.shape[1] + W <= self.budget:     # host-side bound
            return pend_idx, pend_ok, width
        P = pend_ok.sum(1)
        room = self.budget - ledger.alive().sum(1)
        keep_p = torch.minimum(P, (room - 1).clamp(min=1))
        if joining is not None:
            keep_p = torch.where(joining, P, keep_p)
        cut = pend_ok & (torch.arange(pend_idx.shape[1], device=P.device)[None] >= keep_p[:, None])
        if bool(cut.any()):
            gone = torch.zeros_like(self.draft).scatter_(1, pend_idx, cut)
            self.draft &= ~gone
            self.pending &= ~gone
            pend_ok = pend_ok & ~cut
        return pend_idx, pend_ok, torch.minimum(width, (room - keep_p).clamp(min=1))

    @torch.no_grad()
    def _step(self):
        st, runner = self.st, self.runner
        pend_idx, pend_ok, joining = self._pending()
        if joining is None:
            live = st.live()
            if not bool(live.any()):
                return False
        else:
            live = st.live() & ~joining[:, None]
        pend_idx, pend_ok, width = self._fit(pend_idx, pend_ok, joining)
        free = live & ~self.draft
        f = first_true(free)
        active = free & (st.pos[None] < (f + width)[:, None])
        q_idx, q_ok, _ = pack(active)
        logits = yield from runner.run(pend_idx, pend_ok, q_idx, q_ok, logits_rows="all")
        P = pend_idx.shape[1]
        self.shifted.add(pend_idx, pend_ok, logits[:, :P], st.masked)
        if joining is not None:                          # every joining row ran its prefill
            self.prefill.zero_()
            self._joining = False
        is_draft = self.draft.gather(1, pend_idx) & pend_ok
        stepped = live.any(1)
        if not bool(stepped.any()):                      # prefills only: nothing to verify or commit
            runner.persist()
            self.pending.zero_()
            return True
        # the row every draft and query reads (a draft's: its predecessor's clean row, the AR head), then its argmax
        cols = torch.cat([pend_idx, q_idx], 1)
        ok = torch.cat([is_draft, q_ok], 1)
        tok, conf = self.choose(self.shifted.lookup(cols, logits), cols, st, ok)
        B, N = st.tokens.shape
        read = torch.zeros(B, N, dtype=torch.long, device=cols.device).scatter_(1, cols, torch.where(ok, tok, 0))
        read_conf = torch.zeros(B, N, device=cols.device).scatter_(1, cols, torch.where(ok, conf.float(), 0.0))
        pos = st.pos[None]
        bad = first_true(self.draft & (self.view != read))            # the first rejected draft (N: none)
        if st.generators is not None:                                  # sampled rows: the rejection rule
            bad = self._sample(self.shifted.lookup(cols, logits), cols, is_draft, P, q_ok, read, read_conf, bad)
        acc = self.draft & (pos < bad[:, None])
        qf = first_true(active)
        fix = torch.where(bad < N, bad, qf)                            # the correction, or the bonus token
        exact = (pos == fix[:, None]) & stepped[:, None]
        sel = acc | exact
        nxt = active & (bad == N)[:, None] & (pos > qf[:, None])       # the next drafts
        c_idx, c_ok, _ = pack(sel)
        before = st.committed.clone()
        st.commit(c_idx, c_ok, read.gather(1, c_idx), sel, read_conf.gather(1, c_idx), expect=stepped)
        runner.persist(pend_ok & ~(is_draft & ~acc.gather(1, pend_idx)))
        self.shifted.drop(self.draft & ~acc)                           # rejected drafts' clean rows
        self._tally(pend_idx, is_draft, acc, bad, read)
        if st.criteria.enabled:
            self._stops(c_idx, c_ok, sel, before)
        st.end_step()
        alive = ~st.done[:, None]
        self.draft = nxt & alive
        self.pending = (exact | nxt) & alive
        self.view.copy_(torch.where(self.draft, read, st.tokens))
        return True

    def _dist(self, logits: torch.Tensor, opt) -> torch.Tensor:
        """logits [C, V] -> the sampled distribution [C, V] (MASK banned, temperature, nucleus: .sampling's)."""
        logits = logits.float().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
        logits = logits.index_fill(-1, torch.tensor([self.sampler.mask_id], device=logits.device), float("-inf"))
        logits = (logits - logits.amax(-1, keepdim=True)) / max(opt.temperature, torch.finfo(torch.float32).tiny)
        return top_p_filter(torch.softmax(logits, -1), opt.top_p)

    def _sample(self, rows, cols, is_draft, P: int, q_ok, read, read_conf, bad) -> torch.Tensor:
        """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for the rows with a temperature: draft d
        (drawn from q, its MASK row's distribution) is accepted with probability min(1, p(d) / q(d)), p the AR
        head's distribution at its position; the first rejected one is replaced by a draw from max(0, p - q)
        (normalised); with none rejected the first query's token is drawn from p (its row is the AR head's) and the
        later queries' from their own rows (the next drafts, their q kept). The committed tokens are then
        distributed as AR mode's samples. ``read`` / ``read_conf`` [B, N] are rewritten for those rows; returns
        ``bad``."""
        st = self.st
        N = read.shape[1]
        bad = bad.clone()
        for b, opt in enumerate(st.options):
            if opt.temperature <= 0:
                continue
            g = st.generators[b]
            dist = self._dist(rows[b], opt)
            drafts = is_draft[b].nonzero()[:, 0].tolist()
            queries = (P + q_ok[b].nonzero()[:, 0]).tolist()
            rejected = None
            for j, c in enumerate(drafts):
                at, d = int(cols[b, c]), int(self.view[b, int(cols[b, c])])
                p, q = dist[c], self.q[b][j]
                if float(torch.rand((), generator=g, device=p.device)) < min(1.0, float(p[d] / q[d])):
                    read[b, at], read_conf[b, at] = d, p[d]
                    continue
                rest = (p - q).clamp(min=0)
                x = int(torch.multinomial(rest if float(rest.sum()) > 0 else p, 1, generator=g))
                read[b, at], read_conf[b, at], rejected = x, p[x], at
                break
            bad[b] = N if rejected is None else rejected
            self.q[b] = None
            if rejected is None and queries:
                x = torch.multinomial(dist[queries], 1, generator=g)[:, 0]
                at = cols[b, queries]
                read[b, at], read_conf[b, at] = x, dist[queries].gather(1, x[:, None])[:, 0]
                self.q[b] = dist[queries[1:]]
        return bad

    def _tally(self, pend_idx, is_draft, acc, bad, read) -> None:
        """Drafts verified / accepted per window index (the draft's distance from the exact token), and with
        ``record`` each row's drafts, accepted run and correction (decoding/trace.py)."""
        k = (pend_idx - pend_idx[:, :1]).clamp(max=self.cfg.window - 1)
        hit = is_draft & acc.gather(1, pend_idx)
        self.verified.scatter_add_(0, k[is_draft], torch.ones_like(k[is_draft]))
        self.accepted.scatter_add_(0, k[hit], torch.ones_like(k[hit]))
        if self.log is None:
            return
        step = self.st.commit_calls - 1
        for b in is_draft.any(1).nonzero()[:, 0].tolist():
            ps = pend_idx[b][is_draft[b]].tolist()
            n = int(hit[b].sum())
            rej = ps[n] if n < len(ps) else None
            self.log[b].append({"step": step, "positions": ps, "tokens": self.view[b, ps].tolist(), "accepted": n,
                                "rejected": rej, "correction": None if rej is None else int(read[b, rej])})

    def _stops(self, c_idx, c_ok, sel, before) -> None:
        """AR mode's stops after each of the step's tokens in turn: the EOS rule and (after a row's first token) the
        criteria, on the canvas AR mode had then (the step's later tokens still MASK); the output ends where AR
        mode's would."""
        st = self.st
        pos = st.pos[None]
        for i in range(c_idx.shape[1]):
            rows = c_ok[:, i] & ~st.done
            if not bool(rows.any()):
                continue
            masked = st.masked | (sel & (pos > c_idx[:, i:i + 1]))
            if self.cfg.stop_at_eos:
                st.stop(*finish_at_eos(st.tokens, masked, st.eos_ok, st.canvas.infill, st.eos_id, st.done | ~rows))
            due = rows & ~st.done & (before + i > 0)
            if bool(due.any()):
                fm = first_true(masked)
                tokens = torch.where(masked, torch.full_like(st.tokens, self.sampler.mask_id), st.tokens)
                fired, end = st.criteria(tokens, masked, st.conf, ~due, fm + 1)
                st.stop(fired, torch.minimum(end, fm))


__all__ = ["SpeculativeStep", "check_model"]
