"""Step-level batching of the samplers' model calls: every decoding thread's forward fused into one.

Decoding threads (:mod:`.workers`: a session of several jobs' rows, or one job's sampler; samplers unchanged)
run against a :class:`BatchedModel`, which honours the samplers' model protocol (``cache_shape``,
``use_cache``, ``model(tok, pos, keep, start)``, ``training_length``, ``shift_logits``). A call parks the
thread (:meth:`StepHub.submit`); the scheduler, once every thread is parked or finished, fuses the parked
calls into one forward of the real model (:func:`fused_forward`) and hands each call its rows.

Fusion of calls c_i = (tok [b_i, T_i], pos [b_i, T_i], keep [b_i, T_i, C_i + T_i] bool, start s_i, cache_i),
with C_i the capacity of the caller's own KV cache (0 for uncached calls, e.g. MDLM); a single call runs as
it is. Otherwise:

    S = max_i s_i,  R = max_i (T_i - s_i),  T = S + R,  C = max_i C_i,  B = sum_i b_i
    call i's chunk columns go to idx_i = [0, s_i) U [S, S + T_i - s_i) of its b_i fused rows
                                                            (the logits rows aligned at S)
    tokens [B, T] (PAD elsewhere), positions [B, T] (0 elsewhere)
    keep [B, T, C + T]: keep_i[r, j] at [idx_i[r], j] for cache slots j < C_i and
                        keep_i[r, C_i + j] at [idx_i[r], C + idx_i[j]] for chunk columns; False elsewhere
                        (uncached: padding rows see themselves, so no softmax row is empty)
    logits = model(tokens, positions, keep, S)   [B, R, V];   call i gets its rows' logits[:, :T_i - s_i]

Cached calls attend through a :class:`RowCaches` view: each call's chunk K/V are written to the scratch of the
caller's own :class:`~setdiff_mega.decoding.cache.KVCache` (persisted by its sampler as usual), and attention
is one batched SDPA over the rows' cache windows (stacked per layer, zero-padded to C: masked) and the fused
chunk. Caches of different capacity and length coexist, and a thread joining or leaving never copies or
touches another's cache. Per row the attention sees exactly the keys of the call alone (padding keys are
masked), so a request decodes the same tokens whatever else is in the batch (up to the float rounding of
batched matrix products).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Call:
    """One model call of a decoding thread (a request's sampler, or a session of several requests' rows)."""
    tokens: torch.Tensor          # [b, T] long
    positions: torch.Tensor       # [b, T] long
    keep: torch.Tensor            # [b, T, C + T] bool (C = 0 without a cache)
    start: int                    # logits for rows [start, T)
    cache: object = None          # the caller's KVCache with b rows (None: an uncached forward)

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else int(self.cache.capacity)


class RowCaches:
    """The KV-cache interface of a fused forward (module docstring): each call's chunk K/V go to the scratch
    region of the call's own cache (persisted later by the caller's sampler), and attention is one batched SDPA
    over ``[each row's cache window, zero-padded to C ; the fused chunk]`` with the fused keep mask: per layer,
    one copy of every call's windows, no per-row attention."""

    static = False

    def __init__(self, calls: list[Call], columns: list[torch.Tensor], offsets: list[int], capacity: int):
        self.calls, self.columns, self.offsets, self.capacity = calls, columns, offsets, capacity

    def attend(self, layer: int, q, k, v, keep, dropout_p: float = 0.0, scale=None, enable_gqa=False):
        """q [B, h, T, d], k / v [B, g, T, d], keep [B, 1, T, C + T] (bool or additive) -> [B, h, T, d]."""
        B, g, T, d = k.shape
        K = k.new_zeros(B, g, self.capacity + T, d)
        V = v.new_zeros(B, g, self.capacity + T, d)
        K[:, :, self.capacity:] = k
        V[:, :, self.capacity:] = v
        for call, idx, r0 in zip(self.calls, self.columns, self.offsets):
            cache, rows = call.cache, slice(r0, r0 + call.rows)
            if layer == 0:
                cache.begin(call.width)
            cache.write(layer, k[rows][:, :, idx], v[rows][:, :, idx])
            window_k, window_v = cache.window(layer)
            K[rows, :, :cache.capacity] = window_k
            V[rows, :, :cache.capacity] = window_v
        return F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), attn_mask=keep, dropout_p=dropout_p,
                                              scale=scale, enable_gqa=enable_gqa)


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
        c = calls[0]
        if not cached:
            return [model(c.tokens, c.positions, c.keep, c.start)]
        with model.use_cache(c.cache):
            return [model(c.tokens, c.positions, c.keep, c.start)]
    S = max(c.start for c in calls)
    R = max(c.width - c.start for c in calls)
    T, C, B = S + R, max(c.capacity for c in calls), sum(c.rows for c in calls)
    dev = calls[0].tokens.device
    tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)
    positions = torch.zeros(B, T, dtype=torch.long, device=dev)
    keep = torch.zeros(B, T, C + T, dtype=torch.bool, device=dev)
    cols, offsets, r0 = [], [], 0
    for c in calls:
        idx, rows = _columns(c, S), slice(r0, r0 + c.rows)
        tokens[rows, idx] = c.tokens
        positions[rows, idx] = c.positions
        keep[rows, idx[:, None], torch.cat([torch.arange(c.capacity, device=dev), C + idx])[None]] = c.keep
        cols.append(idx)
        offsets.append(r0)
        r0 += c.rows
    if not cached:
        keep |= torch.eye(T, dtype=torch.bool, device=dev)[None] & ~keep.any(-1, keepdim=True)
        out = model(tokens, positions, keep, S)
    else:
        with model.use_cache(RowCaches(calls, cols, offsets, C)):
            out = model(tokens, positions, keep, S)
    return [out[o:o + c.rows, :c.width - c.start] for o, c in zip(offsets, calls)]


class Cancelled(Exception):
    """Raised inside a request's sampler thread at its next model call once the request is cancelled."""


class BatchedModel:
    """The samplers' model interface over a :class:`StepHub`: each call parks the calling thread until the
    scheduler has run it fused with the other running requests' calls."""

    def __init__(self, model, hub: "StepHub"):
        self.model, self.hub = model, hub
        for attr in ("training_length", "shift_logits", "vocab_size", "tokenizer_hash", "weights_kind"):
            if hasattr(model, attr):
                setattr(self, attr, getattr(model, attr))
        self._local = threading.local()

    def parameters(self):
        return self.model.parameters()

    def eval(self):
        return self

    def cache_shape(self):
        return self.model.cache_shape()

    @contextlib.contextmanager
    def use_cache(self, cache):
        self._local.cache = cache
        try:
            yield cache
        finally:
            self._local.cache = None

    def __call__(self, tokens, position_ids, keep, logits_start: int = 0, attention_pattern=None):
        return self.hub.submit(Call(tokens, position_ids, keep, int(logits_start), getattr(self._local, "cache", None)))


class StepHub:
    """Where request threads park their model calls (one parked call per thread at a time).

    The scheduler registers a request (:meth:`register`, before starting its thread, so that the thread counts
    as computing from the start); the thread binds itself to it (:meth:`bind`), parks in :meth:`submit` until
    :meth:`release` hands it its logits (or :class:`Cancelled`), and leaves (:meth:`leave`).
    :meth:`wait_parked` blocks the scheduler until every registered thread is parked. ``cond`` guards the
    bookkeeping and wakes only the scheduler; each thread waits on an event of its own (no thundering herd).
    """

    def __init__(self):
        self.cond = threading.Condition()
        self._local = threading.local()
        self.busy: set = set()            # registered keys computing (not parked)
        self.parked: dict = {}            # key -> Call
        self.results: dict = {}           # key -> logits or an exception
        self.cancelled: set = set()
        self.events: dict = {}            # key -> threading.Event (its result is ready)

    def register(self, key) -> None:
        """A request about to start (``cond`` held by the caller)."""
        self.busy.add(key)
        self.events[key] = threading.Event()

    def bind(self, key) -> None:
        """The calling thread decodes request ``key``."""
        self._local.key = key

    def leave(self) -> None:
        key = self._local.key
        with self.cond:
            self.busy.discard(key)
            self.parked.pop(key, None)
            self.results.pop(key, None)
            self.cancelled.discard(key)
            self.events.pop(key, None)
            self.cond.notify_all()

    def submit(self, call: Call):
        key = self._local.key
        with self.cond:
            if key in self.cancelled:
                raise Cancelled()
            event = self.events[key]
            event.clear()
            self.busy.discard(key)
            self.parked[key] = call
            if not self.busy:
                self.cond.notify_all()
        event.wait()
        with self.cond:
            out = self.results.pop(key)
        if isinstance(out, BaseException):
            raise out
        return out

    def _wake(self, key, result) -> None:
        self.results[key] = result
        self.busy.add(key)
        self.events[key].set()

    def cancel(self, key) -> None:
        """The request's thread raises :class:`Cancelled` at its next call (at once when parked)."""
        with self.cond:
            if key not in self.events:
                return
            self.cancelled.add(key)
            if key in self.parked:
                del self.parked[key]
                self._wake(key, Cancelled())
            self.cond.notify_all()

    def wait_parked(self, timeout: float | None = None) -> bool:
        """Block (``cond`` held by the caller) until no registered thread is computing; False on timeout."""
        return self.cond.wait_for(lambda: not self.busy, timeout)

    def take(self) -> dict:
        """The parked calls (``cond`` held), removed from the parking."""
        calls, self.parked = self.parked, {}
        return calls

    def release(self, results: dict) -> None:
        """Hand each parked key its logits (or exception); the keys count as computing until they park or
        leave again."""
        with self.cond:
            for key, result in results.items():
                if key in self.events:
                    self._wake(key, result)


__all__ = ["Call", "RowCaches", "fused_forward", "BatchedModel", "StepHub", "Cancelled"]
