"""Which calls of a scheduler step share a forward: joining rows' prefills apart from the decoding rows.

A fused forward (:func:`~setdiff_mega.decoding.calls.fused_forward`) pads every row to the widest call's
columns. A request that joins a running decode brings its whole prompt as pending entries (tens of columns)
while every other row decodes a chunk of a few, so in one forward all B rows pay for the prompt's width: on
CPU, at the main job's shape, such a step cost 3.3x a plain one (21.1 against 6.4 ms at 8 rows, 38 against 7
columns on average). So each step's cached calls are cut in two by width:

* **Rows of a call.** A cached call whose ``pending_count`` is known holds per row b its p_b valid pending
  entries at the start of its P pending columns. Its rows with p_b <= c form a narrower call (columns
  ``[0, c) U [P, T)``, their own cache rows), the others keep the full width; the cut c maximises the
  padding saved, ``n_{p <= c} x (P - c)`` row-positions.
* **Calls of a step.** The step's (partial) calls, by width: those at most w wide go to one forward, the
  wider ones to another, w maximising ``sum_{width <= w} rows x (W_max - w_max)``.

A cut is taken when it saves at least ``min_saving`` row-positions (a second forward costs its fixed part;
on CPU that is about 64 row-positions of the tiny model, on a GPU far more: :func:`default_min_saving`).
The wide forward runs first, and every cache of a cut call has reserved the call's full width before either
(:meth:`KVCache.begin`), so the window never moves between the two. Each row attends to exactly the keys it
would in the uncut call, and its logits go back to the call's own layout (:func:`stitch`): the decode sees
the same logits, up to the float rounding of differently batched products.
"""
from __future__ import annotations

import torch

from setdiff_mega.decoding.calls import Call


def default_min_saving(device) -> int:
    """Row-positions a second forward must save: 64 on CPU (measured), 4096 elsewhere (launch-bound)."""
    return 64 if torch.device(device).type == "cpu" else 4096


def _best_cut(items: list[tuple[int, int]], full: int) -> tuple[int, int]:
    """items [(rows, width)]: the width w <= full whose items (width <= w) save the most padding; (w, saved)."""
    best, saved = full, 0
    for w in sorted({w for _, w in items if w < full}):
        s = sum(r for r, x in items if x <= w) * (full - w)
        if s > saved:
            best, saved = w, s
    return best, saved


def _sub(call: Call, rows: torch.Tensor, width: int) -> tuple[Call, torch.Tensor]:
    """Rows ``rows`` of ``call`` with its pending columns cut to ``width``; (sub-call, its kept columns)."""
    P, T, C = call.pending_width, call.width, call.capacity
    dev = call.tokens.device
    cols = torch.cat([torch.arange(width, device=dev), torch.arange(P, T, device=dev)])
    keys = torch.cat([torch.arange(C, device=dev), C + cols])
    start = int((cols < call.start).sum())
    sub = Call(call.tokens[rows][:, cols], call.positions[rows][:, cols], call.keep[rows][:, cols][:, :, keys],
               start, call.cache.rows(rows), call.pending_count[rows], width,
               None if call.valid is None else call.valid[rows][:, cols])
    return sub, cols


def split_rows(call: Call, min_saving: int) -> list[tuple[Call, torch.Tensor | None, torch.Tensor | None]]:
    """``call`` as [(call, rows, columns)]: itself (rows None), or its wide and narrow row sets (module
    docstring); the caches of a cut call reserve its full width now."""
    if call.cache is None or call.pending_count is None or call.rows == 1:
        return [(call, None, None)]
    counts = call.pending_count.tolist()
    w, saved = _best_cut([(1, c) for c in counts], call.pending_width)
    if saved < min_saving or all(c <= w for c in counts):
        return [(call, None, None)]
    call.cache.begin(call.width)
    narrow = torch.tensor([c <= w for c in counts], device=call.tokens.device)
    out = []
    for rows, width in ((~narrow).nonzero()[:, 0], call.pending_width), (narrow.nonzero()[:, 0], w):
        sub, cols = _sub(call, rows, width)
        out.append((sub, rows, cols))
    return out


def groups(calls: list[Call], min_saving: int) -> list[list[int]]:
    """Indices of ``calls`` per forward: one group, or [wide, narrow] when the cut saves ``min_saving``."""
    if len(calls) < 2:
        return [list(range(len(calls)))]
    full = max(c.width for c in calls)
    w, saved = _best_cut([(c.rows, c.width) for c in calls], full)
    if saved < min_saving:
        return [list(range(len(calls)))]
    return [[i for i, c in enumerate(calls) if c.width > w], [i for i, c in enumerate(calls) if c.width <= w]]


def stitch(call: Call, parts: list) -> torch.Tensor:
    """The logits of ``call`` [b, T - s, V] from its parts' [(logits, rows, columns)] (module docstring)."""
    if len(parts) == 1 and parts[0][1] is None:
        return parts[0][0]
    V = parts[0][0].shape[-1]
    out = parts[0][0].new_zeros(call.rows, call.width - call.start, V)
    for logits, rows, cols in parts:
        at = cols[cols >= call.start] - call.start
        out[rows[:, None], at[None]] = logits
    return out


__all__ = ["default_min_saving", "split_rows", "groups", "stitch"]
