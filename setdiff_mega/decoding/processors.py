"""Logits processors, applied per candidate row on the raw logits, as the reference does (method.md 5.5).

For the candidate rows of a step, logits [B, A, V] at positions q_idx [B, A] of the canvas:

    1. repetition penalty p (transformers' ``RepetitionPenaltyLogitsProcessor``): every token id in the
       row's context gets  s < 0 ? s * p : s / p.  Context = the committed tokens of the generation
       region for plain prompts; every visible token (prefix, suffix and the infilled tokens) for
       infill requests (the reference's ``infill_repetition_penalty_include_right_context``)
    2. exponential-decay length penalty (start, factor), transformers' ``ExponentialDecayLengthPenalty``
       with ``input_ids_seq_length = 0`` evaluated per row: with c = the number of visible tokens of the
       generation region left of the row's position,  s_eos += |s_eos| * (factor ** (c - start) - 1)
       when c > start (the reference's ``_length_penalty_prefix_lengths``)
    3. MASK excluded (logit -inf); nothing else is banned (EOS may equal PAD: GPT-2 / Qwen tokenizers)

then :func:`~setdiff_mega.decoding.sampling.choose_tokens` (temperature, nucleus keeping the crossing
token, confidence = probability of the chosen token after the filter). Rows are processed together;
the length penalty is written here in batched form because transformers' processor takes a single
length per call (tests check it against transformers' on every row).
"""
from __future__ import annotations

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from .sampling import choose_tokens


def repetition_context(tokens: torch.Tensor, masked: torch.Tensor, generate: torch.Tensor, valid: torch.Tensor,
                       infill: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: the tokens a row's repetition penalty counts (see the module docstring)."""
    visible = valid & ~masked
    return torch.where(infill[:, None], visible, visible & generate)


def repetition_penalty(logits: torch.Tensor, tokens: torch.Tensor, context: torch.Tensor,
                       penalty: float) -> torch.Tensor:
    """logits [B, A, V]; context [B, N] bool over tokens [B, N] -> penalised logits (transformers' rule)."""
    B, A, V = logits.shape
    ids = torch.where(context, tokens, torch.full_like(tokens, V))     # V: outside the vocabulary, ignored
    proc = RepetitionPenaltyLogitsProcessor(float(penalty))
    out = proc(ids.repeat_interleave(A, 0), logits.reshape(B * A, V))
    return out.view(B, A, V)


def prefix_lengths(q_idx: torch.Tensor, masked: torch.Tensor, generate: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
    """[B, A]: visible tokens of the generation region (from its first position) left of each q_idx."""
    N = masked.shape[1]
    pos = torch.arange(N, device=masked.device)
    start = torch.where(generate, pos, torch.full_like(pos, N)).min(1).values
    region = valid & ~masked & (pos[None] >= start[:, None])
    excl = torch.cat([torch.zeros_like(start[:, None]), region.long().cumsum(1)], 1)    # [B, N + 1]
    return excl.gather(1, q_idx)


def length_penalty(logits: torch.Tensor, prefix: torch.Tensor, eos_id: int, start: int, factor: float) -> torch.Tensor:
    """logits [B, A, V], prefix [B, A] -> logits with the EOS score raised after ``start`` tokens."""
    s = logits[..., eos_id]
    idx = (prefix - start).clamp(min=0).to(s.dtype)
    pen = s.abs() * (torch.pow(torch.full_like(s, float(factor)), idx) - 1.0)
    pen = torch.where((prefix > start) & torch.isfinite(s), pen, torch.zeros_like(pen))
    out = logits.clone()
    out[..., eos_id] = s + pen
    return out


class LogitsPipeline:
    """Processors + token choice for one sampler run (config read once; the sampling options per row, from the
    state: rows of a shared serving session may differ in temperature, top_p and repetition penalty)."""

    def __init__(self, cfg, mask_id: int, eos_id: int):
        self.cfg, self.mask_id, self.eos_id = cfg, mask_id, eos_id
        lp = cfg.length_penalty
        self.length = None if lp is None else (int(lp[0]), float(lp[1]))

    def __call__(self, logits: torch.Tensor, q_idx: torch.Tensor, st, q_ok: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, A, V] for canvas positions q_idx [B, A] (valid where ``q_ok``, packed first) of DecodeState
        ``st`` -> (tokens, confidence); sampled tokens come from each row's own generator. Rows are processed in
        groups of equal options, each group exactly as a batch of its rows alone would be."""
        logits = logits.float()
        groups: dict = {}
        for b, opt in enumerate(st.options):
            groups.setdefault(opt, []).append(b)
        if len(groups) == 1:
            return self._choose(logits, q_idx, st, q_ok, st.options[0], None)
        tok = torch.empty(logits.shape[:-1], dtype=torch.long, device=logits.device)
        conf = torch.empty(logits.shape[:-1], device=logits.device)
        for opt, rows in groups.items():
            idx = torch.tensor(rows, device=logits.device)
            tok[idx], conf[idx] = self._choose(logits[idx], q_idx[idx], st, None if q_ok is None else q_ok[idx],
                                               opt, rows)
        return tok, conf

    def _choose(self, logits, q_idx, st, q_ok, opt, rows: list[int] | None):
        """One group of rows (``rows`` of the state; None: all of them) with options ``opt``."""
        cv = st.canvas
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        if opt.repetition_penalty != 1.0:
            ctx = repetition_context(st.tokens, st.masked, cv.generate, cv.valid, cv.infill)
            logits = repetition_penalty(logits, pick(st.tokens), pick(ctx), opt.repetition_penalty)
        if self.length is not None:
            pre = prefix_lengths(q_idx, pick(st.masked), pick(cv.generate), pick(cv.valid))
            logits = length_penalty(logits, pre, self.eos_id, *self.length)
        gens = st.generators if rows is None or st.generators is None else [st.generators[b] for b in rows]
        counts = q_ok.sum(1).tolist() if opt.temperature > 0 and q_ok is not None else None
        return choose_tokens(logits, [self.mask_id], generator=gens, counts=counts, **opt.choice())


__all__ = ["LogitsPipeline", "repetition_context", "repetition_penalty", "prefix_lengths", "length_penalty"]
