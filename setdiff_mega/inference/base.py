"""Shared pieces of the samplers: requests as a batched canvas, the configuration and the outputs.

A batch of B requests is one canvas: ``tokens`` [B, N] (long), ``generate`` [B, N] (bool: positions
still to be filled, initially MASK), ``valid`` [B, N] (inside the row; rows are right-padded with PAD)
and ``infill`` [B] (the row has visible tokens after its MASK span). A plain prompt ``p`` becomes
``p + [MASK] * max_new_tokens``; a prompt that already contains MASK tokens is an infill request and
is decoded as given. Positions are absolute: position i of a row has RoPE position i.

Packing: :func:`pack` turns a selection [B, N] into per-row index lists [B, M] (ascending positions,
padded, with a validity mask), the form every chunk is built from, so no sampler loops over rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64      # plain prompts: MASK positions appended after the prompt
    window: int = 4               # SetDLM: positional window W from the leftmost masked position
    tau: float = 0.9              # commit every token with confidence >= tau (> 1: one token per step)
    commit_k: int = 1             # always commit the k most confident tokens of the active set
    block_size: int = 4           # BD3LM block size S; MDLM semi-autoregressive block size
    temperature: float = 0.0      # 0 = greedy
    top_p: float = 1.0            # nucleus filter (sampling only)
    use_cache: bool = True        # False: full recompute every step (exactness reference)
    cache_capacity: int | None = None   # None: the whole canvas; smaller evicts the oldest entries
    stop_at_eos: bool = True      # plain prompts stop at the first generated EOS
    stop_strings: tuple = ()      # checked every W steps on the decoded generation
    seed: int = 0                 # sampling RNG
    record: bool = False          # keep the canvas after every step in GenerationOutput.trace

    def validate(self) -> "GenerationConfig":
        if self.window < 1:
            raise ValueError(f"window W={self.window} must be >= 1")
        if self.commit_k < 1:
            raise ValueError(f"commit_k={self.commit_k} must be >= 1")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        return self


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
    def from_prompts(prompts: list[list[int]], mask_id: int, pad_id: int, max_new_tokens: int,
                     max_length: int | None = None, device="cpu") -> "Canvas":
        rows, gens, infill = [], [], []
        for i, p in enumerate(prompts):
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
            if max_length is not None and len(rows[-1]) > max_length:
                raise ValueError(f"request {i}: {len(p)} prompt tokens + {len(rows[-1]) - len(p)} to generate = "
                                 f"{len(rows[-1])} positions exceed the model's context of {max_length}; "
                                 f"shorten the prompt or lower max_new_tokens")
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

    @property
    def tokens_per_step(self) -> list[float]:
        return [c / s if s else 0.0 for c, s in zip(self.committed, self.steps)]


def pack(sel: torch.Tensor, width: int | None = None):
    """sel [B, N] bool -> (idx [B, M] long ascending positions, ok [B, M] bool, count [B])."""
    B, N = sel.shape
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


def finish_at_eos(tokens, masked, generate, infill, eos_id, done):
    """Rows (not infill) whose first generated EOS has no MASK before it are done: (newly [B], end [B] or -1)."""
    N = tokens.shape[1]
    eos = generate & ~masked & (tokens == eos_id)
    first_eos = first_true(eos)
    first_mask = first_true(masked)
    newly = (~done) & (~infill) & (first_eos < N) & (first_mask > first_eos)
    end = torch.where(newly, first_eos + 1, torch.full_like(first_eos, -1))
    return newly, end


class DecodeState:
    """Per-batch decoding state shared by the samplers: the canvas being filled and the bookkeeping.

    ``tokens`` / ``masked`` [B, N] are updated in place (chunk builders keep references to them);
    :meth:`commit` writes chosen tokens, :meth:`end_step` applies the EOS rule and retires finished rows.
    """

    def __init__(self, canvas: Canvas, cfg: GenerationConfig, eos_id: int):
        self.canvas, self.cfg, self.eos_id = canvas, cfg, eos_id
        self.tokens = canvas.tokens.clone()
        self.masked = canvas.generate.clone()
        B, N = self.tokens.shape
        dev = self.tokens.device
        self.pos = torch.arange(N, device=dev)
        self.done = ~self.masked.any(1)
        self.end = torch.full((B,), -1, dtype=torch.long, device=dev)
        self.steps = torch.zeros(B, dtype=torch.long, device=dev)
        self.committed = torch.zeros(B, dtype=torch.long, device=dev)
        self.history: list = []
        self.trace: list = []
        self.generator = torch.Generator(device=dev).manual_seed(cfg.seed)

    def live(self) -> torch.Tensor:
        """[B, N] masked positions of rows still decoding."""
        return self.masked & ~self.done[:, None]

    def commit(self, q_idx: torch.Tensor, cm: torch.Tensor, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Write x[b, j] at position q_idx[b, j] where cm[b, j] (restricted to ``allowed``); returns sel [B, N]."""
        B, N = self.tokens.shape
        sel = torch.zeros(B, N, dtype=torch.bool, device=q_idx.device).scatter_(1, q_idx, cm) & allowed
        vals = torch.zeros(B, N, dtype=torch.long, device=q_idx.device).scatter_(1, q_idx, torch.where(cm, x, 0))
        self.tokens[sel] = vals[sel]
        self.masked &= ~sel
        n = sel.sum(1)
        self.committed += n
        self.steps += (n > 0).long()
        self.history.append(n.tolist())
        if self.cfg.record:
            self.trace.append(self.tokens.clone())
        return sel

    def stop(self, newly: torch.Tensor, end: torch.Tensor) -> None:
        """Retire rows ``newly`` with their output ending before position ``end``."""
        self.end = torch.where(newly, end, self.end)
        self.done |= newly

    def end_step(self) -> None:
        if self.cfg.stop_at_eos:
            newly, e = finish_at_eos(self.tokens, self.masked, self.canvas.generate, self.canvas.infill,
                                        self.eos_id, self.done)
            self.stop(newly, e)
        self.done |= ~self.masked.any(1)

    def output(self, nfe: int) -> "GenerationOutput":
        return collect(self.canvas, self.tokens, self.masked, self.end, nfe, self.steps, self.committed,
                       self.history, self.trace)


def collect(canvas: Canvas, tokens, masked, end, nfe, steps, committed, history, trace=None) -> GenerationOutput:
    """Per-row generated tokens (generation region up to ``end``, remaining MASK dropped)."""
    out_tokens, seqs = [], []
    N = tokens.shape[1]
    for b in range(tokens.shape[0]):
        e = int(end[b]) if int(end[b]) >= 0 else N
        keep = canvas.valid[b, :e] & ~masked[b, :e]
        gen = canvas.generate[b, :e] & keep
        out_tokens.append(tokens[b, :e][gen].tolist())
        seqs.append(tokens[b, :e][keep].tolist())
    return GenerationOutput(out_tokens, seqs, nfe, steps.tolist(), committed.tolist(), history, trace or [])


__all__ = ["GenerationConfig", "Canvas", "GenerationOutput", "DecodeState", "pack", "first_true", "finish_at_eos", "collect"]
