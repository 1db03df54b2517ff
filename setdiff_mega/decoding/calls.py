"""Decoding as step functions: a sampler's decode is a state machine that asks for model calls and is handed their
logits; whoever owns the model (``generate``'s loop, the export's ``model.generate``, the server's scheduler)
runs the calls, alone or fused with other decodes' calls into one forward.

The protocol of a decode state (every sampler's session: :mod:`.setdlm`, :mod:`.baselines`)::

    calls = state.next_calls()     # [] : no row has work (a session may admit rows and be asked again)
    state.advance([logits_i])      # the logits of each call, in order; the step's bookkeeping runs
    state.admit(b, ids, n) / state.retire(b)   # between steps: a request joins / leaves row b

:func:`drive` is the in-process loop (``while calls := next_calls(): advance(forward(calls))``). Internally a
step is a generator (:class:`Stepper`): it builds its call, ``yield``s it, receives the logits and finishes its
bookkeeping; a step with nothing to compute (e.g. an uncached prefill) yields nothing.

A :class:`Call` c = (tok [b, T] long, pos [b, T] long, keep [b, T, C + T] bool, start s, cache) is the model
protocol's call (``with model.use_cache(cache): model(tok, pos, keep, s)`` -> logits [b, T - s, V]), C the
capacity of the caller's KV cache (0 for uncached calls). A cached call may say which chunk entries are real
(``valid`` [b, T]; the rest is padding: rows' shorter pending runs and windows, fusion's filler); a model with
``ragged = True`` is then called with ``valid=`` and leaves the padding out of its products (their logits are
never read). Fusion of calls c_i (:func:`fused_forward`; a single
call runs as it is):

    S = max_i s_i,  R = max_i (T_i - s_i),  T = S + R,  C = max_i C_i,  B = sum_i b_i
    call i's chunk columns go to idx_i = [0, s_i) U [S, S + T_i - s_i) of its b_i fused rows
                                                            (the logits rows aligned at S)
    tokens [B, T] (PAD elsewhere), positions [B, T] (0 elsewhere)
    keep [B, T, C + T]: keep_i[r, j] at [idx_i[r], j] for cache slots j < C_i and
                        keep_i[r, C_i + j] at [idx_i[r], C + idx_i[j]] for chunk columns; False elsewhere
                        (uncached: padding rows see themselves, so no softmax row is empty)
    logits = model(tokens, positions, keep, S)   [B, R, V];   call i gets its rows' logits[:, :T_i - s_i]

Cached calls attend through a :class:`RowCaches` view: the products run over the fused rows, and attention per
call, through the caller's own :class:`~.cache.KVCache` (its chunk K/V written to the cache's scratch, persisted
by its sampler as usual; its window read as views, never copied) on the call's rows and chunk columns under its
own keep mask, exactly as the call alone would. So a request decodes the same tokens whatever else is in the
forward (up to the float rounding of batched matrix products), and fusing costs no copy of any cache (a batched
SDPA over windows stacked per layer cost a copy of every window per layer: at GPT-2-small shape ~1 GB per step).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class Call:
    """One model call of a decode (module docstring)."""
    tokens: torch.Tensor          # [b, T] long
    positions: torch.Tensor       # [b, T] long
    keep: torch.Tensor            # [b, T, C + T] bool (C = 0 without a cache)
    start: int                    # logits for rows [start, T)
    cache: object = None          # the caller's KVCache (or rows of it) with b rows; None: uncached
    pending_count: torch.Tensor | None = None   # [b]: row b's valid entries lead columns [0, pending_width)
    pending_width: int = 0        # (set by cached chunk forwards: a scheduler may cut the padding, serving/fusion)
    valid: torch.Tensor | None = None   # [b, T] bool: the chunk's real entries (cached calls; None: all of them)

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else int(self.cache.capacity)


def _run(model, tokens, positions, keep, start, valid):
    """``model(tokens, positions, keep, start)``, with ``valid=`` for a model that skips padding in its products
    (``model.ragged``: the plain decode forward, hfmodel/decode_step.py); others compute the padding too."""
    if valid is not None and getattr(model, "ragged", False):
        return model(tokens, positions, keep, start, valid=valid)
    return model(tokens, positions, keep, start)


def forward(model, call: Call) -> torch.Tensor:
    """One call alone: logits [b, T - s, V]."""
    if call.cache is None:
        return model(call.tokens, call.positions, call.keep, call.start)
    with model.use_cache(call.cache):
        return _run(model, call.tokens, call.positions, call.keep, call.start, call.valid)


class RowCaches:
    """The KV-cache interface of a fused forward (module docstring): the products run over every call's rows at
    once, attention per call: its rows' queries, keys and values at its chunk columns attend through the call's
    own cache (which writes their K/V to its scratch region, persisted later by the caller's sampler, and reads
    its window as views: no window is copied) under the call's own keep mask; the padding columns get zeros."""

    static = False

    def __init__(self, calls: list[Call], columns: list[torch.Tensor], offsets: list[int], capacity: int):
        self.calls, self.columns, self.offsets, self.capacity = calls, columns, offsets, capacity
        # each call's boolean keep as SDPA's additive mask, built once per forward instead of once per layer
        self.masks = [torch.zeros(c.keep.shape, device=c.keep.device).masked_fill_(~c.keep, float("-inf"))[:, None]
                      for c in calls]

    def attend(self, layer: int, q, k, v, keep, dropout_p: float = 0.0, scale=None, enable_gqa=False, kernel=None):
        """q [B, h, T, d], k / v [B, g, T, d] (``keep``, the fused mask, is not needed) -> [B, h, T, d]."""
        out = q.new_zeros(q.shape)
        for call, idx, r0, mask in zip(self.calls, self.columns, self.offsets, self.masks):
            rows = slice(r0, r0 + call.rows)
            out[rows, :, idx] = call.cache.attend(layer, q[rows][:, :, idx], k[rows][:, :, idx], v[rows][:, :, idx],
                                                  mask, dropout_p, scale, enable_gqa, kernel=kernel).to(q.dtype)
        return out


def _columns(call: Call, S: int) -> torch.Tensor:
    """Where the call's chunk entries sit in its fused rows: [0, s) then [S, S + T - s)."""
    dev = call.tokens.device
    return torch.cat([torch.arange(call.start, device=dev), S + torch.arange(call.width - call.start, device=dev)])


def fused_forward(model, calls: list[Call], pad_id: int) -> list[torch.Tensor]:
    """One forward of ``model`` for ``calls`` (all cached or all uncached); returns each call's logits
    [b, T - s, V] (see the module docstring). A single call runs as it is, through its own cache."""
    cached = calls[0].cache is not None
    if any((c.cache is not None) != cached for c in calls):
        raise ValueError("fused_forward takes cached or uncached calls, not both")
    if len(calls) == 1:
        return [forward(model, calls[0])]
    S = max(c.start for c in calls)
    R = max(c.width - c.start for c in calls)
    T, C, B = S + R, max(c.capacity for c in calls), sum(c.rows for c in calls)
    dev = calls[0].tokens.device
    tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)
    positions = torch.zeros(B, T, dtype=torch.long, device=dev)
    keep = torch.zeros(B, T, C + T, dtype=torch.bool, device=dev)
    valid = torch.zeros(B, T, dtype=torch.bool, device=dev) if cached else None
    cols, offsets, r0 = [], [], 0
    for c in calls:
        idx, rows = _columns(c, S), slice(r0, r0 + c.rows)
        tokens[rows, idx] = c.tokens
        positions[rows, idx] = c.positions
        if valid is not None:
            valid[rows, idx] = True if c.valid is None else c.valid
        keep[rows, idx[:, None], torch.cat([torch.arange(c.capacity, device=dev), C + idx])[None]] = c.keep
        cols.append(idx)
        offsets.append(r0)
        r0 += c.rows
    if not cached:
        keep |= torch.eye(T, dtype=torch.bool, device=dev)[None] & ~keep.any(-1, keepdim=True)
        out = model(tokens, positions, keep, S)
    else:
        with model.use_cache(RowCaches(calls, cols, offsets, C)):
            out = _run(model, tokens, positions, keep, S, valid)
    return [out[o:o + c.rows, :c.width - c.start] for o, c in zip(offsets, calls)]


class Stepper(abc.ABC):
    """The state-machine face of a decode whose step is the generator :meth:`_step` (module docstring): it
    yields at most one :class:`Call`, receives its logits, and returns whether any row had work."""

    _gen = None
    _call = None

    @abc.abstractmethod
    def _step(self):
        """One step as a generator: yield the step's :class:`Call` (at most one), receive its logits, return
        whether any row had work."""

    def next_calls(self) -> list[Call]:
        """The model calls of the next step ([] when no row has work left)."""
        while self._call is None:
            gen = self._step()
            try:
                self._call = next(gen)
            except StopIteration as e:
                if not e.value:
                    return []
                continue                  # a step without a forward (e.g. an uncached prefill)
            self._gen = gen
        return [self._call]

    def advance(self, logits: list) -> None:
        """Hand the step its calls' logits (in the order of :meth:`next_calls`); its bookkeeping runs."""
        gen, self._gen, self._call = self._gen, None, None
        if gen is None:
            raise RuntimeError("advance() without a call from next_calls()")
        try:
            gen.send(logits[0])
        except StopIteration:
            return
        raise RuntimeError("a decode step makes at most one model call")

    @property
    def in_step(self) -> bool:
        """A call was handed out and its logits are awaited (no row may join or leave now)."""
        return self._call is not None


@torch.no_grad()
def drive(model, state) -> None:
    """Run ``state`` to the end, calling ``model`` itself (the in-process loop)."""
    while calls := state.next_calls():
        state.advance([forward(model, c) for c in calls])


__all__ = ["Call", "forward", "RowCaches", "fused_forward", "Stepper", "drive"]
