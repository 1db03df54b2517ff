"""The decoding context: which committed tokens each forward may attend, and how it is cropped to L.

Samplers with a KV cache (SetDLM, AR, BD3LM) run one forward per step over a chunk
``[pending P_b ; queries A_b]``; the pending tokens' K/V are persisted afterwards. The model was trained
on L positions, so, exactly as the reference does before every forward (method.md 5.2, P15), each row
keeps ``cached_b + P_b + A_b <= budget`` (budget = the training length L by default) by evicting

    drop_b = cached_b + P_b + A_b - budget        entries, chosen by the policy:
    "oldest"    the first ones in insertion order (the reference's ``_crop_kv_cache_left``)
    "position"  the ones with the smallest positions, ties by insertion order (the FHT ledger,
                ``_select_kv_cache_positions``; method.md 4.6)

Positions keep growing past L - 1 (RoPE is applied at absolute positions).

:class:`Ledger` keeps, per row and in insertion order (index j < n_b): ``pos`` [B, N] (absolute
position), ``step`` [B, N] (the forward that computed the token's K/V), ``group`` [B, N] (tokens of one
group are computed together and see each other: a BD3LM block; otherwise the insertion index) and
``gone`` [B, N] (the forward before which the token was evicted; ``ALIVE`` while cached). What the cache
implies is then a mask over the insertion history, which the uncached reference recomputes in full:

    history token j sees i   iff  (i <= j  or  group_i == group_j)  and  gone_i > step_j
    a row of forward f sees i  iff  gone_i > f        (every cached token, whatever its position;
                                                      P16: visibility follows insertion, not position)

so cache on and cache off give the same tokens even after evictions. The cached entries of a row, in
insertion order, are exactly the slots of :class:`~setdiff_mega.decoding.cache.KVCache`.
"""
from __future__ import annotations

import torch

ALIVE = torch.iinfo(torch.long).max


class ContextOverflow(ValueError):
    """A chunk that does not fit the context budget even with an empty cache."""


class Ledger:
    def __init__(self, batch: int, size: int, budget: int | None, by_position: torch.Tensor | None = None,
                 device="cpu"):
        """``by_position`` [B] bool: rows evicting by smallest position ("position"); the others "oldest"."""
        self.budget, self.by_position = budget, by_position
        shape = (batch, size + 1)                           # column ``size`` absorbs padded scatters
        self._pos = torch.zeros(shape, dtype=torch.long, device=device)
        self._step = torch.zeros(shape, dtype=torch.long, device=device)
        self._group = torch.zeros(shape, dtype=torch.long, device=device)
        self.gone = torch.full((batch, size), ALIVE, dtype=torch.long, device=device)
        self.n = torch.zeros(batch, dtype=torch.long, device=device)
        self.evicted = 0
        self._bound = 0             # an upper bound on any row's cached count (host side: no sync)

    @property
    def pos(self) -> torch.Tensor:
        return self._pos[:, :-1]

    @property
    def step(self) -> torch.Tensor:
        return self._step[:, :-1]

    @property
    def group(self) -> torch.Tensor:
        return self._group[:, :-1]

    @property
    def size(self) -> int:
        return self.pos.shape[1]

    def inserted(self) -> torch.Tensor:
        """[B, N] bool: history slots in use."""
        return torch.arange(self.size, device=self.n.device)[None] < self.n[:, None]

    def alive(self) -> torch.Tensor:
        """[B, N] bool: inserted tokens still in the cache."""
        return self.inserted() & (self.gone == ALIVE)

    def reset_row(self, b: int) -> None:
        """Row ``b`` starts a new request: nothing inserted (the bound on cached counts stays an upper bound)."""
        self.n[b] = 0
        self.gone[b] = ALIVE
        self._bound = int(self.alive().sum(1).max())

    def evict_for(self, chunk: torch.Tensor, forward: int, width: int | None = None) -> torch.Tensor | None:
        """Make room for ``chunk`` [B] new tokens (at most ``width``) before ``forward``; returns the
        KV-cache keep mask [B, N] over cache slots (None when nothing is evicted)."""
        width = int(chunk.max()) if width is None and chunk.numel() else (width or 0)
        if self.budget is None or self._bound + width <= self.budget:
            return None                                    # cannot overflow yet (checked on the host)
        alive = self.alive()
        count = alive.sum(1)
        drop = (count + chunk - self.budget).clamp(min=0)
        if not bool(drop.any()):
            return None
        if bool((drop > count).any()):
            b = int((drop > count).nonzero()[0, 0])
            raise ContextOverflow(f"row {b}: a chunk of {int(chunk[b])} tokens does not fit the context budget of "
                                  f"{self.budget} tokens; lower the window (or the prompt length)")
        slot = alive.long().cumsum(1) - 1                         # cache slot of each alive entry
        rank = slot
        if self.by_position is not None and bool(self.by_position.any()):
            key = torch.where(alive, self.pos, torch.full_like(self.pos, ALIVE))
            order = torch.sort(key, dim=1, stable=True).indices
            by_pos = torch.empty_like(order).scatter_(1, order, torch.arange(self.size, device=order.device)
                                                      .expand_as(order))
            rank = torch.where(self.by_position[:, None], by_pos, slot)
        out = alive & (rank < drop[:, None])
        self.gone = torch.where(out, torch.full_like(self.gone, forward), self.gone)
        self.evicted += int(out.sum())
        self._bound = int((count - out.sum(1)).max())
        keep = torch.ones(alive.shape[0], self.size + 1, dtype=torch.bool, device=alive.device)
        keep.scatter_(1, torch.where(out, slot, torch.full_like(slot, self.size)), False)
        return keep[:, :self.size]

    def append(self, idx: torch.Tensor, ok: torch.Tensor, forward: int, group: torch.Tensor | None = None) -> None:
        """Insert the packed positions ``idx[ok]`` [B, M] (in that order) computed in ``forward``."""
        M = idx.shape[1]
        if M == 0:
            return
        N = self.size
        j = torch.arange(M, device=idx.device)[None]
        dest = torch.where(ok, self.n[:, None] + j, torch.full_like(j, N))
        self._pos.scatter_(1, dest, idx)
        self._step.scatter_(1, dest, torch.full_like(idx, forward))
        self._group.scatter_(1, dest, dest if group is None else group)
        self.n = self.n + ok.sum(1)
        self._bound += M

    def history(self):
        """(pos [B, H], ok [B, H], mask [B, H, H]): the whole insertion history and its visibility."""
        H = int(self.n.max()) if self.n.numel() else 0
        ok = self.inserted()[:, :H]
        i = torch.arange(H, device=self.n.device)
        before = (i[None, :, None] >= i[None, None, :]) | (self.group[:, :H, None] == self.group[:, None, :H])
        seen = self.gone[:, None, :H] > self.step[:, :H, None]
        return self.pos[:, :H] * ok, ok, before & seen & ok[:, None, :] & ok[:, :, None]


__all__ = ["Ledger", "ContextOverflow", "ALIVE"]
