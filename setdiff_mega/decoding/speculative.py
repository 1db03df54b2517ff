"""Self-speculative decoding of a SetDLM (method.md 16, issue 59): the model's own greedy left-to-right answer, several
tokens per forward, drafted by the set sampler and verified by the same network's next-token head in the same
forward.

A SetDLM trained with the AR head shift (``model.shift_logits``) and the next-token loss (``objective.ar_weight``
> 0) holds two predictors: the clean row of position p - 1 predicts p (its AR mode: SetDLM at W = 1, :mod:`.shift`)
and the MASK rows of a window predict their positions from the committed tokens alone (the set sampler). Per row the
decode keeps ``e`` (the last exact token, committed, not cached yet) and the drafts d_1..d_m after it; one forward
over the grouped chunk

    [e, d_1, .., d_m  (pending: clean, causal) ; groups j = 0..m of MASK queries]
    group j  = the row's live (masked) positions of index j .. j + W - 1 within W positions of the first, g_j
               (g_j = d_{j+1}'s position for j < m, the position after d_m for j = m): the window AR mode's next
               step would draft from had exactly d_1..d_j been accepted; column (j, 0) only for j = m (the
               "bonus"; for j < m its position holds d_{j+1}, whose verifier already is the correction there)
    a query of group j sees the cache, e, d_1..d_j and itself (never d_{j+1}.., never another query)

(``ChunkRunner.run``'s ``query_pending``; (W - 1)(m + 1) + 1 query rows, at most W^2 - W + 1 at m = W - 1) gives,
with the shift's reading rule (:class:`~.shift.PredecessorRows`), y_i = argmax of the row d_i's position reads
(the clean row of e or d_{i-1}: the AR head on exactly the tokens before it) and each query's token (the bonus
column: d_m's clean row, as AR mode reads it; the other columns: their own MASK rows, the drafts):

    j       = the longest prefix with d_i == y_i                 (accepted drafts)
    j < m:  commit d_1..d_j and the correction y_{j+1}
    j == m: commit d_1..d_m and the bonus token (exact)
    drafts  group j's other columns' tokens become the next drafts (they saw exactly the accepted prefix):
            every forward verifies drafts whatever the rejection; the other m groups' rows are dropped
    cache   e, d_1..d_j (the accepted run leads the chunk: ``ChunkRunner.persist(keep)``); rejected drafts' K/V and
            kept clean rows are dropped

so every committed token is the AR head's argmax on the tokens before it: the output is AR mode's (SetDLM with
W = 1, greedy), token for token up to float rounding, with j + 1 tokens per forward (at most W). Nothing is
recomputed: the kept group's rows are the next drafts as they are, and a draft's clean row (its verifier's input)
is computed once, in the next forward, as a pending token. One forward per step, always. A draft of group j did
not see the correction or bonus token at g_j (it comes from the same forward), so the draft at distance k from the
next exact token is a (k + 1)-token-ahead prediction. Rows accept different lengths (all bookkeeping is per row;
the cache commits per-row counts; rows with fewer drafts have fewer groups, the rest of the columns is padding).

Exactly as AR mode also in its stops and context: EOS ends a row at its first eligible EOS, and the stopping
criteria are evaluated after every committed token on the canvas AR mode had then (tokens after it still MASK),
at AR mode's cadence (after every step but the first). The context budget holds the forward's span, P + 1 tokens
(a query sees the pending entries and itself: ``ChunkRunner.run``'s ``span``), as AR mode's chunk of e and one
query does; near the budget a row's drafts are cut so that nothing is evicted before AR mode would evict, down to
the exact token alone, whose forward evicts as AR mode's does. Rows with a temperature sample their drafts and
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
        """Per row (not joining) the pending entries cut to the drafts that still fit under the context budget
        (module docstring; the cut ones are forgotten): the forward's span is P + 1 (a query sees the pending
        entries and itself), so ``cached + P + 1 <= budget`` leaves nothing evicted before AR mode evicts."""
        ledger = self.runner.ledger
        if self.budget is None or ledger._bound + pend_idx.shape[1] + 1 <= self.budget:     # host-side bound
            return pend_idx, pend_ok
        P = pend_ok.sum(1)
        keep_p = torch.minimum(P, (self.budget - ledger.alive().sum(1) - 1).clamp(min=1))
        if joining is not None:
            keep_p = torch.where(joining, P, keep_p)
        cut = pend_ok & (torch.arange(pend_idx.shape[1], device=P.device)[None] >= keep_p[:, None])
        if bool(cut.any()):
            gone = torch.zeros_like(self.draft).scatter_(1, pend_idx, cut)
            self.draft &= ~gone
            self.pending &= ~gone
            pend_ok = pend_ok & ~cut
        return pend_idx, pend_ok

    def _groups(self, pend_idx, pend_ok, is_draft, live):
        """The grouped queries (module docstring): one group per possible accepted prefix j = 0..m_b, W columns
        each (column (j, k) at the row's live position of index j + k, within W positions of the group's first):
        ``q_idx`` / ``q_ok`` / ``group`` [B, G W] (G = max m_b + 1), ``bonus`` [B, G W] (column (m_b, 0): the
        position after the last draft, read from its predecessor's clean row) and ``visible`` [B, G W, P] (group j
        sees the pending entries that are not drafts and the drafts d_1..d_j). Column (j, 0) of j < m_b is left
        out (its position holds d_{j+1}, whose verifier already is the correction there)."""
        W = self.cfg.window
        B, P = pend_idx.shape
        m = is_draft.sum(1)
        G = int(m.max()) + 1 if P else 1
        lidx, lok, _ = pack(live)
        M = lidx.shape[1]
        dev = live.device
        j = torch.arange(G, device=dev)[None, :, None]
        k = torch.arange(W, device=dev)[None, None, :]
        at = (j + k).expand(B, G, W)
        pos = lidx.gather(1, at.clamp(max=max(M - 1, 0)).reshape(B, -1)).view(B, G, W) if M else at * 0
        mj = m[:, None, None]
        ok = (at < lok.sum(1)[:, None, None]) & (pos < pos[:, :, :1] + W) & (j <= mj) & ((k > 0) | (j == mj))
        rank = is_draft.long().cumsum(1) - 1
        see = pend_ok[:, None, :] & (~is_draft[:, None, :] | (rank[:, None, :] < j[:, :, 0, None]))   # [B, G, P]
        visible = see[:, :, None, :].expand(B, G, W, P).reshape(B, G * W, P)
        group = j.expand(B, G, W).reshape(B, -1)
        bonus = (ok & (j == mj) & (k == 0)).reshape(B, -1)
        return (pos * ok).reshape(B, -1), ok.reshape(B, -1), group, bonus, visible

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
        pend_idx, pend_ok = self._fit(pend_idx, pend_ok, joining)
        is_draft = self.draft.gather(1, pend_idx) & pend_ok
        q_idx, q_ok, group, bonus, visible = self._groups(pend_idx, pend_ok, is_draft, live)
        span = pend_ok.sum(1) + q_ok.any(1).long()
        logits = yield from runner.run(pend_idx, pend_ok, q_idx, q_ok, logits_rows="all", query_pending=visible,
                                       span=span)
        P = pend_idx.shape[1]
        self.shifted.add(pend_idx, pend_ok, logits[:, :P], st.masked)
        if joining is not None:                          # every joining row ran its prefill
            self.prefill.zero_()
            self._joining = False
        stepped = live.any(1)
        if not bool(stepped.any()):                      # prefills only: nothing to verify or commit
            runner.persist()
            self.pending.zero_()
            return True
        # a draft reads its predecessor's clean row (the AR head), the bonus too; the other queries their own rows
        own = logits[:, P:]
        rows = torch.cat([self.shifted.lookup(pend_idx, logits[:, :P]),
                          torch.where(bonus[..., None], self.shifted.lookup(q_idx, own), own)], 1)
        tok, conf = self.choose(rows, torch.cat([pend_idx, q_idx], 1), st, torch.cat([is_draft, q_ok], 1))
        conf = conf.float()
        B, N = st.tokens.shape
        read = torch.zeros(B, N, dtype=torch.long, device=tok.device).scatter_(
            1, pend_idx, torch.where(is_draft, tok[:, :P], 0))
        read_conf = torch.zeros(B, N, device=tok.device).scatter_(1, pend_idx, torch.where(is_draft, conf[:, :P], 0))
        qtok, qconf = tok[:, P:].clone(), conf[:, P:].clone()
        bad = first_true(self.draft & (self.view != read))            # the first rejected draft (N: none)
        if st.generators is not None:                                  # sampled rows: the rejection rule
            bad = self._sample(rows, P, pend_idx, is_draft, (group, q_ok, bonus), read, read_conf, qtok, qconf, bad)
        self._commit(stepped, pend_idx, pend_ok, is_draft, bad, read, read_conf,
                     (q_idx, q_ok, group, bonus, qtok, qconf))
        return True

    def _commit(self, stepped, pend_idx, pend_ok, is_draft, bad, read, read_conf, queries) -> None:
        """Commit the accepted drafts and the correction (or the bonus token), cache the accepted run, and keep the
        group of the accepted prefix as the next drafts (``queries``: the query columns, their validity, group,
        bonus flag, tokens and confidences)."""
        st = self.st
        q_idx, q_ok, group, bonus, qtok, qconf = queries
        B, N = st.tokens.shape
        pos = st.pos[None]
        acc = self.draft & (pos < bad[:, None])
        kept = q_ok & (group == acc.sum(1, keepdim=True))              # the group of the accepted prefix
        b_col = (kept & bonus).long().argmax(1, keepdim=True)          # its bonus column (j = m_b: none rejected)
        has_bonus = (kept & bonus).any(1)
        qf = torch.where(has_bonus, q_idx.gather(1, b_col)[:, 0], N)
        at = qf.clamp(max=N - 1)[:, None]
        read.scatter_(1, at, torch.where(has_bonus[:, None], qtok.gather(1, b_col), read.gather(1, at)))
        read_conf.scatter_(1, at, torch.where(has_bonus[:, None], qconf.gather(1, b_col), read_conf.gather(1, at)))
        fix = torch.where(bad < N, bad, qf)                            # the correction, or the bonus token
        exact = (pos == fix[:, None]) & stepped[:, None]
        sel = acc | exact
        nd = kept & ~bonus                                             # the kept group's drafts
        sink = torch.where(nd, q_idx, N)
        nxt = torch.zeros(B, N + 1, dtype=torch.bool, device=pos.device).scatter_(1, sink, True)[:, :N]
        dtok = torch.zeros(B, N + 1, dtype=torch.long, device=pos.device).scatter_(1, sink, qtok)[:, :N]
        c_idx, c_ok, _ = pack(sel)
        before = st.committed.clone()
        st.commit(c_idx, c_ok, read.gather(1, c_idx), sel, read_conf.gather(1, c_idx), expect=stepped)
        self.runner.persist(pend_ok & ~(is_draft & ~acc.gather(1, pend_idx)))
        self.shifted.drop(self.draft & ~acc)                           # rejected drafts' clean rows
        self._tally(pend_idx, is_draft, acc, bad, read)
        if st.criteria.enabled:
            self._stops(c_idx, c_ok, sel, before)
        st.end_step()
        alive = ~st.done[:, None]
        self.draft = nxt & alive
        self.pending = (exact | nxt) & alive
        self.view.copy_(torch.where(self.draft, dtok, st.tokens))

    def _dist(self, logits: torch.Tensor, opt) -> torch.Tensor:
        """logits [C, V] -> the sampled distribution [C, V] (MASK banned, temperature, nucleus: .sampling's)."""
        logits = logits.float().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
        logits = logits.index_fill(-1, torch.tensor([self.sampler.mask_id], device=logits.device), float("-inf"))
        logits = (logits - logits.amax(-1, keepdim=True)) / max(opt.temperature, torch.finfo(torch.float32).tiny)
        return top_p_filter(torch.softmax(logits, -1), opt.top_p)

    def _sample(self, rows, P: int, pend_idx, is_draft, queries, read, read_conf, qtok, qconf, bad) -> torch.Tensor:
        """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for the rows with a temperature: draft d
        (drawn from q, its MASK row's distribution) is accepted with probability min(1, p(d) / q(d)), p the AR
        head's distribution at its position; the first rejected one is replaced by a draw from max(0, p - q)
        (normalised). The group of the accepted prefix is then drawn: with none rejected its bonus column from p
        (its row is the AR head's), its other columns (the next drafts) from their own rows, q kept. The committed
        tokens are then distributed as AR mode's samples. ``rows`` [B, P + A, V] (the rows each column reads),
        ``read`` / ``read_conf`` [B, N] and ``qtok`` / ``qconf`` [B, A] are rewritten for those rows; returns
        ``bad``."""
        st = self.st
        group, q_ok, bonus = queries
        N = read.shape[1]
        bad = bad.clone()
        for b, opt in enumerate(st.options):
            if opt.temperature <= 0:
                continue
            g = st.generators[b]
            rejected, j = None, 0
            for i, c in enumerate(is_draft[b].nonzero()[:, 0].tolist()):
                at = int(pend_idx[b, c])
                d = int(self.view[b, at])
                p, q = self._dist(rows[b, c], opt), self.q[b][i]
                if float(torch.rand((), generator=g, device=p.device)) < min(1.0, float(p[d] / q[d])):
                    read[b, at], read_conf[b, at], j = d, p[d], j + 1
                    continue
                rest = (p - q).clamp(min=0)
                x = int(torch.multinomial(rest if float(rest.sum()) > 0 else p, 1, generator=g))
                read[b, at], read_conf[b, at], rejected = x, p[x], at
                break
            bad[b] = N if rejected is None else rejected
            self.q[b] = None
            cols = (q_ok[b] & (group[b] == j)).nonzero()[:, 0]
            if len(cols):
                dist = self._dist(rows[b, P + cols], opt)
                x = torch.multinomial(dist, 1, generator=g)[:, 0]
                qtok[b, cols], qconf[b, cols] = x, dist.gather(1, x[:, None])[:, 0]
                self.q[b] = dist[~bonus[b, cols]]
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
