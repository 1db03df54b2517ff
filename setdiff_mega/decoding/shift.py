"""The AR head alignment at decoding time (``model.shift_logits``, method.md 13): which logit row predicts a
masked position, read exactly as the training objectives read it.

* SetDLM: a masked position p reads the clean row of p - 1 once p - 1 is committed (its rank is then below
  p's, as in training), its own (MASK) row otherwise. A committed token's clean row is computed once, in the
  forward that writes its K/V (its pending row, or the prefill), and its logits never change afterwards, so
  :class:`PredecessorRows` keeps them while the successor is still masked, as a packed table per row:

      pos [B, K] long (the committed position; -2 = empty), val [B, K, V] (its clean row's logits)

  K stays below the number of masked positions that follow a committed one (the window, plus one per MASK
  span of an infill request).
* BD3LM (:func:`block_rows`): inside a block the query row of p - 1; at a block's first position the clean
  row of p - 1 (the previous block's last token, a pending row of the block's first forward, kept for the
  block's later steps); at position 0 its own row.
* MDLM (:func:`view_rows`): the row of p - 1 within the canvas view, its own row at the view's start.
"""
from __future__ import annotations

import torch

from .base import pack

EMPTY = -2            # never q - 1 for a query q >= 0


class PredecessorRows:
    """Clean-row logits of committed positions whose successor is still masked (see the module docstring)."""

    def __init__(self):
        self.pos = None
        self.val = None

    def add(self, idx: torch.Tensor, ok: torch.Tensor, logits: torch.Tensor, masked: torch.Tensor) -> None:
        """Rows ``idx`` [B, P] (valid where ``ok``) just computed as clean rows with ``logits`` [B, P, V];
        ``masked`` [B, N]: the canvas's masked positions. Entries whose successor is no longer masked go."""
        B, N = masked.shape
        if self.pos is None:
            self.pos = idx.new_full((B, 0), EMPTY)
            self.val = logits.new_zeros(B, 0, logits.shape[-1])
        pos = torch.cat([self.pos, torch.where(ok, idx, torch.full_like(idx, EMPTY))], 1)
        val = torch.cat([self.val, logits.to(self.val.dtype)], 1)
        succ = pos + 1
        keep = (pos >= 0) & (succ < N) & masked.gather(1, succ.clamp(0, N - 1))
        col, col_ok, _ = pack(keep)
        self.pos = torch.where(col_ok, pos.gather(1, col), torch.full_like(col, EMPTY))
        self.val = val.gather(1, col[..., None].expand(*col.shape, val.shape[-1]))

    def drop(self, sel: torch.Tensor) -> None:
        """Entries at the positions ``sel`` [B, N] go (self-speculation: the clean rows of rejected drafts)."""
        if self.pos is not None and self.pos.shape[1]:
            gone = (self.pos >= 0) & sel.gather(1, self.pos.clamp(min=0))
            self.pos = torch.where(gone, torch.full_like(self.pos, EMPTY), self.pos)

    def reset_row(self, b: int) -> None:
        """Row ``b`` starts a new request: its kept rows go."""
        if self.pos is not None:
            self.pos[b] = EMPTY

    def lookup(self, q_idx: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """Queries at ``q_idx`` [B, A] with their own rows ``own`` [B, A, V] -> the rows they read."""
        if self.pos is None or self.pos.shape[1] == 0:
            return own
        match = self.pos[:, None, :] == (q_idx - 1)[:, :, None]                # [B, A, K]
        slot = match.float().argmax(-1)
        got = self.val.gather(1, slot[..., None].expand(*slot.shape, self.val.shape[-1]))
        return torch.where(match.any(-1)[..., None], got.to(own.dtype), own)


def block_rows(logits: torch.Tensor, P: int, p_idx: torch.Tensor, p_ok: torch.Tensor, q_idx: torch.Tensor,
               edge: torch.Tensor | None):
    """BD3LM: ``logits`` [B, P + A, V] of a chunk [pending ; the current block, contiguous from its start]
    -> (the rows the block's queries read [B, A, V], ``edge`` [B, V]: the clean row of the block's
    predecessor position, kept for the block's later forwards)."""
    own = logits[:, P:]
    B, V = own.shape[0], own.shape[-1]
    if edge is None:
        edge = own.new_zeros(B, V)
    if P:
        last = (p_ok.sum(1) - 1).clamp(min=0)
        is_pred = p_ok.any(1) & (p_idx.gather(1, last[:, None])[:, 0] == q_idx[:, 0] - 1)
        cand = logits[:, :P].gather(1, last[:, None, None].expand(B, 1, V))[:, 0]
        edge = torch.where(is_pred[:, None], cand, edge)
    first = torch.where((q_idx[:, 0] > 0)[:, None], edge, own[:, 0])
    return torch.cat([first[:, None], own[:, :-1]], 1), edge


def view_rows(rel: torch.Tensor) -> torch.Tensor:
    """MDLM: the queries' rows ``rel`` [B, A] in a view of the canvas -> the rows they read (p - 1)."""
    return torch.where(rel > 0, rel - 1, rel)


__all__ = ["PredecessorRows", "block_rows", "view_rows"]
