"""Shared pieces of the samplers: requests as a batched canvas, the configuration and the outputs.

A batch of B requests is one canvas: ``tokens`` [B, N] (long), ``generate`` [B, N] (bool: positions
still to be filled, initially MASK), ``valid`` [B, N] (inside the row; rows are right-padded with PAD)
and ``infill`` [B] (the row has visible tokens after its MASK span). A plain prompt ``p`` becomes
``p + [MASK] * max_new_tokens``; a prompt that already contains MASK tokens is an infill request and
is decoded as given. Positions are absolute: position i of a row has RoPE position i, also past the
model's training length L (the samplers keep at most L tokens in view: :mod:`.context`).

Packing: :func:`pack` turns a selection [B, N] into per-row index lists [B, M] (ascending positions,
padded, with a validity mask), the form every chunk is built from, so no sampler loops over rows.

EOS rule (plain prompts, ``stop_at_eos``): a row is done once its first EOS at generated index
>= ``min_new_tokens`` - 1 has no MASK before it; the output ends with that EOS. Earlier EOS tokens
stay in the text (the reference's ``EntropyEosStoppingCriteria`` with ``var_length``: an EOS stops
decoding only after the minimum length). Checking this every step gives the same output as checking
it every W steps, because the tokens before that EOS are all committed and never change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import BOUNDS, MAX_TOKENS, GenerationConfig
from .sampling import RowOptions
from .stopping import StopCriteria


@dataclass
class Canvas:
    tokens: torch.Tensor      # [B, N] long
    generate: torch.Tensor    # [B, N] bool
    valid: torch.Tensor       # [B, N] bool
    infill: torch.Tensor      # [B] bool

    @property
    def shape(self):
        return tuple(self.tokens.shape)

    @staticmethod
    def empty(batch: int, width: int, pad_id: int, device="cpu") -> "Canvas":
        """``batch`` rows of ``width`` positions holding no request (every row finished; a session admits into
        them)."""
        z = torch.zeros(batch, width, dtype=torch.bool, device=device)
        return Canvas(torch.full((batch, width), pad_id, dtype=torch.long, device=device), z, z.clone(),
                      torch.zeros(batch, dtype=torch.bool, device=device))

    def put_row(self, b: int, ids: list[int], mask_id: int, pad_id: int, max_new_tokens: int) -> None:
        """Row ``b`` holds request ``ids`` instead (continuous batching; the layout of :meth:`from_prompts`)."""
        row = Canvas.from_prompts([ids], mask_id, pad_id, max_new_tokens, device=self.tokens.device)
        n, N = row.tokens.shape[1], self.tokens.shape[1]
        if n > N:
            raise ValueError(f"a request of {n} positions does not fit the session's width of {N}")
        self.tokens[b], self.generate[b], self.valid[b] = pad_id, False, False
        self.tokens[b, :n], self.generate[b, :n], self.valid[b, :n] = row.tokens[0], row.generate[0], row.valid[0]
        self.infill[b] = row.infill[0]

    @staticmethod
    def from_prompts(prompts: list[list[int]], mask_id: int, pad_id: int, max_new_tokens: int,
                     device="cpu") -> "Canvas":
        rows, gens, infill = [], [], []
        for p in prompts:
            p = [int(t) for t in p]
            if mask_id in p:
                m = [t == mask_id for t in p]
                last = max(j for j, x in enumerate(m) if x)
                infill.append(last < len(p) - 1)
                rows.append(p)
                gens.append(m)
            else:
                rows.append(p + [mask_id] * max_new_tokens)
                gens.append([False] * len(p) + [True] * max_new_tokens)
                infill.append(False)
        N = max(len(r) for r in rows)
        B = len(rows)
        tokens = torch.full((B, N), pad_id, dtype=torch.long)
        gen = torch.zeros(B, N, dtype=torch.bool)
        valid = torch.zeros(B, N, dtype=torch.bool)
        for b, (r, g) in enumerate(zip(rows, gens)):
            tokens[b, :len(r)] = torch.tensor(r)
            gen[b, :len(g)] = torch.tensor(g)
            valid[b, :len(r)] = True
        return Canvas(tokens.to(device), gen.to(device), valid.to(device), torch.tensor(infill, device=device))


@dataclass
class GenerationOutput:
    tokens: list[list[int]]             # generated tokens per row (generation region, no MASK)
    sequences: list[list[int]]          # the whole decoded canvas per row (prompt + generation)
    nfe: int                            # forward passes for the batch (prefill included)
    steps: list[int]                    # decode steps in which each row committed tokens
    committed: list[int]                # tokens committed per row
    history: list = field(default_factory=list)   # per step: [B] tokens committed (for inspection)
    trace: list = field(default_factory=list)     # per step: canvas [B, N] (only with record=True)
    evicted: int = 0                    # cache entries dropped to stay within the context budget
    commit_steps: list = field(default_factory=list)  # per row, per token of ``tokens``: the 0-based commit
                                                      # call that wrote it (only with record=True)
    confidences: list = field(default_factory=list)   # per row, per token of ``tokens``: its confidence then
    positions: list = field(default_factory=list)     # per row, per token of ``tokens``: its canvas position
                                                      # (only with record=True; decoding/trace.py)
    speculation: dict = field(default_factory=dict)   # speculative decoding (decoding/speculative.py): drafts
                                                      # verified / accepted per window index, per-row draft logs

    @property
    def tokens_per_step(self) -> list[float]:
        return [c / s if s else 0.0 for c, s in zip(self.committed, self.steps)]


def pack(sel: torch.Tensor, width: int | None = None):
    """sel [B, N] bool -> (idx [B, M] long ascending positions, ok [B, M] bool, count [B])."""
    B, N = sel.shape
    if B == 1 and width is None:                    # batch 1: the positions themselves, in three operations
        idx = sel[0].nonzero()[:, 0][None]
        M = idx.shape[1]
        return idx, torch.ones(1, M, dtype=torch.bool, device=sel.device), idx.new_full((1,), M)
    count = sel.sum(1)
    M = (int(count.max()) if count.numel() else 0) if width is None else width
    pos = torch.arange(N, device=sel.device)
    key = torch.where(sel, pos, pos + N)
    idx = key.argsort(-1)[:, :M]
    ok = torch.arange(M, device=sel.device)[None] < count[:, None]
    return torch.where(ok, idx, torch.zeros_like(idx)), ok, count


def first_true(sel: torch.Tensor) -> torch.Tensor:
    """[B, N] bool -> [B] index of the first True (N if none)."""
    N = sel.shape[1]
    pos = torch.arange(N, device=sel.device)
    return torch.where(sel, pos, torch.full_like(pos, N)).min(1).values


def eos_positions(generate: torch.Tensor, min_new_tokens: int = 0) -> torch.Tensor:
    """[B, N] bool: generated positions at index >= min_new_tokens - 1, where an EOS may end the output."""
    return generate & (generate.long().cumsum(1) > min_new_tokens - 1)


def finish_at_eos(tokens, masked, eligible, infill, eos_id, done):
    """Rows (not infill) whose first EOS at an ``eligible`` position (:func:`eos_positions`) has no MASK
    before it: (newly [B], end [B] or -1)."""
    N = tokens.shape[1]
    eos = eligible & ~masked & (tokens == eos_id)
    first_eos = first_true(eos)
    first_mask = first_true(masked)
    newly = (~done) & (~infill) & (first_eos < N) & (first_mask > first_eos)
    end = torch.where(newly, first_eos + 1, torch.full_like(first_eos, -1))
    return newly, end


class NoProgress(ValueError):
    """A decode step committed nothing for a row that had work (the request fails; the loop never spins)."""


class DecodeState:
    """Per-batch decoding state shared by the samplers: the canvas being filled and the bookkeeping.

    ``tokens`` / ``masked`` [B, N] are updated in place (chunk builders keep references to them);
    ``conf`` [B, N] holds the confidence each token was committed with (1 for given tokens, NaN while
    masked); :meth:`commit` writes chosen tokens, :meth:`end_step` applies the EOS rule and retires
    finished rows, :meth:`check_stops` the stopping criteria. ``observer`` (optional) is called with the state
    after every step's bookkeeping (:meth:`end_step`; a server streams the tokens that became final).
    """

    def __init__(self, canvas: Canvas, cfg: GenerationConfig, eos_id: int, mask_id: int, tokenizer=None,
                 observer=None):
        self.canvas, self.cfg, self.eos_id = canvas, cfg, eos_id
        self.tokens = canvas.tokens.clone()
        self.masked = canvas.generate.clone()
        B, N = self.tokens.shape
        dev = self.tokens.device
        self.pos = torch.arange(N, device=dev)
        self.conf = torch.where(self.masked, torch.full((B, N), float("nan"), device=dev),
                                torch.ones(B, N, device=dev))
        self.done = ~self.masked.any(1)
        self.end = torch.full((B,), -1, dtype=torch.long, device=dev)
        self.steps = torch.zeros(B, dtype=torch.long, device=dev)
        self.committed = torch.zeros(B, dtype=torch.long, device=dev)
        self.history: list = []
        self.commit_calls = 0                         # commit calls so far (a server trims ``history``)
        self.trace: list = []
        self.options = [RowOptions.of(cfg)] * B       # each row's temperature, top_p, repetition penalty
        self.generators = None                        # sampling: one stream per row (its request's seed)
        if cfg.temperature > 0:
            self._make_generators()
        self.criteria = StopCriteria(cfg, tokenizer, canvas, mask_id)
        self.eos_ok = eos_positions(canvas.generate, cfg.min_new_tokens)
        self.track_conf = cfg.stop_confidence is not None or cfg.record
        self.commit_step = torch.full((B, N), -1, dtype=torch.long, device=dev) if cfg.record else None
        self.observer = observer

    def _make_generators(self) -> None:
        dev = self.tokens.device
        self.generators = [torch.Generator(device=dev).manual_seed(self.cfg.seed) for _ in range(len(self.options))]

    def reset_row(self, b: int, seed: int | None = None, options: RowOptions | None = None) -> None:
        """Row ``b`` of the canvas was rewritten with a new request (continuous batching): its state starts
        again (its sampling stream from ``seed``, default the config's; its sampling ``options``, default the
        config's); the other rows are untouched."""
        self.options[b] = options or RowOptions.of(self.cfg)
        if self.generators is None and self.options[b].temperature > 0:
            self._make_generators()
        if self.generators is not None:
            self.generators[b].manual_seed(self.cfg.seed if seed is None else int(seed))
        cv = self.canvas
        self.tokens[b] = cv.tokens[b]
        self.masked[b] = cv.generate[b]
        self.conf[b] = torch.where(cv.generate[b], torch.full_like(self.conf[b], float("nan")),
                                   torch.ones_like(self.conf[b]))
        self.done[b] = not bool(cv.generate[b].any())
        self.end[b] = -1
        self.steps[b] = 0
        self.committed[b] = 0
        self.eos_ok[b] = eos_positions(cv.generate[b:b + 1], self.cfg.min_new_tokens)[0]
        if self.commit_step is not None:
            self.commit_step[b] = -1
        self.criteria.reset_row(b)

    def live(self) -> torch.Tensor:
        """[B, N] masked positions of rows still decoding."""
        return self.masked & ~self.done[:, None]

    def commit(self, q_idx: torch.Tensor, cm: torch.Tensor, x: torch.Tensor, allowed: torch.Tensor,
               conf: torch.Tensor | None = None, expect: torch.Tensor | None = None) -> torch.Tensor:
        """Write x[b, j] at position q_idx[b, j] where cm[b, j] (restricted to ``allowed``); returns sel [B, N].
        ``expect`` [B]: rows that must commit at least one token (a step that cannot make progress fails with
        :class:`NoProgress` instead of looping)."""
        B, N = self.tokens.shape
        sel = torch.zeros(B, N, dtype=torch.bool, device=q_idx.device).scatter_(1, q_idx, cm) & allowed
        vals = torch.zeros(B, N, dtype=torch.long, device=q_idx.device).scatter_(1, q_idx, torch.where(cm, x, 0))
        self.tokens.copy_(torch.where(sel, vals, self.tokens))          # in place, no host sync
        if conf is not None and self.track_conf:
            c = torch.zeros(B, N, device=q_idx.device).scatter_(1, q_idx, torch.where(cm, conf.float(), 0.0))
            self.conf = torch.where(sel, c, self.conf)
        self.masked &= ~sel
        n = sel.sum(1)
        self.commit_calls += 1
        self.committed += n
        self.steps += (n > 0).long()
        if expect is None:
            self.history.append(n.tolist())
        else:
            counts, due = torch.stack([n, expect.long()]).tolist()           # one host sync
            self.history.append(counts)
            stuck = [b for b, (c, d) in enumerate(zip(counts, due)) if d and not c]
            if stuck:
                raise NoProgress(f"decoding made no progress in row {stuck[0]} (step {len(self.history)}): no "
                                 f"position could be committed; check window, commit_k and block_size")
        if self.cfg.record:
            self.trace.append(self.tokens.clone())
            self.commit_step = torch.where(sel, self.commit_calls - 1, self.commit_step)   # this call's index
        return sel

    def stop(self, newly: torch.Tensor, end: torch.Tensor) -> None:
        """Retire rows ``newly`` with their output ending before position ``end``."""
        self.end = torch.where(newly, end, self.end)
        self.done |= newly

    def end_step(self) -> None:
        if self.cfg.stop_at_eos:
            newly, e = finish_at_eos(self.tokens, self.masked, self.eos_ok, self.canvas.infill, self.eos_id,
                                     self.done)
            self.stop(newly, e)
        self.done |= ~self.masked.any(1)
        if self.observer is not None:
            self.observer(self)

    def check_stops(self, limit: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Stopping criteria on the prefix [0, limit) of the rows still decoding (only ``rows`` [B] if
        given; see :mod:`.stopping`)."""
        if self.criteria.enabled:
            skip = self.done if rows is None else self.done | ~rows
            fired, end = self.criteria(self.tokens, self.masked, self.conf, skip, limit)
            self.stop(fired, end)

    def output(self, nfe: int, evicted: int = 0, rows: slice = slice(None)) -> "GenerationOutput":
        """The decoded rows (``rows``: a slice, e.g. one finished request of a continuous batch; the per-step
        history and trace only for the whole batch)."""
        cv, r = self.canvas, rows
        whole = r == slice(None)
        canvas = cv if whole else Canvas(cv.tokens[r], cv.generate[r], cv.valid[r], cv.infill[r])
        out = collect(canvas, self.tokens[r], self.masked[r], self.end[r], nfe, self.steps[r], self.committed[r],
                      self.history if whole else [], self.trace if whole else None)
        out.evicted = evicted
        if self.cfg.record:
            out.commit_steps = generated(canvas, self.masked[r], self.end[r], self.commit_step[r])
            out.confidences = generated(canvas, self.masked[r], self.end[r], self.conf[r])
            out.positions = generated(canvas, self.masked[r], self.end[r], self.pos.expand_as(self.conf[r]))
        return out


def generated(canvas: Canvas, masked, end, values: torch.Tensor) -> list[list]:
    """Per row, ``values`` [B, N] at the generated tokens (generation region up to ``end``, MASK dropped)."""
    out = []
    N = values.shape[1]
    for b in range(values.shape[0]):
        e = int(end[b]) if int(end[b]) >= 0 else N
        out.append(values[b, :e][canvas.valid[b, :e] & ~masked[b, :e] & canvas.generate[b, :e]].tolist())
    return out


def collect(canvas: Canvas, tokens, masked, end, nfe, steps, committed, history, trace=None) -> GenerationOutput:
    """Per-row generated tokens (generation region up to ``end``, remaining MASK dropped)."""
    seqs = []
    N = tokens.shape[1]
    for b in range(tokens.shape[0]):
        e = int(end[b]) if int(end[b]) >= 0 else N
        seqs.append(tokens[b, :e][canvas.valid[b, :e] & ~masked[b, :e]].tolist())
    return GenerationOutput(generated(canvas, masked, end, tokens), seqs, nfe, steps.tolist(), committed.tolist(),
                            history, trace or [])


__all__ = ["GenerationConfig", "BOUNDS", "MAX_TOKENS", "NoProgress", "Canvas", "GenerationOutput", "DecodeState",
           "pack", "first_true", "finish_at_eos", "eos_positions", "collect", "generated"]
