"""A scripted backbone for sampler tests (in the style of nanochat's mock-model engine tests).

``ScriptedModel(table)`` returns, for every row at position p, the logits ``table[p]`` ([P, V]; rows
past the table repeat its last row) whatever the context, so every decision of a sampler can be
computed by hand. It honours the samplers' model protocol (``cache_shape``, ``use_cache``,
``forward(tokens, positions, mask, logits_start)``); under the cache it writes each token's position
as its key, so :attr:`calls` records, for every forward, the chunk's tokens and positions and, per
chunk row, the positions it could attend (cache slots + chunk), i.e. what the model saw.
"""
from __future__ import annotations

import contextlib

import torch


class ScriptedModel(torch.nn.Module):
    def __init__(self, table: torch.Tensor, training_length: int | None = None):
        super().__init__()
        self.table = table.float()
        self.vocab_size = table.shape[1]
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.calls: list[dict] = []
        self._cache = None
        if training_length is not None:
            self.training_length = training_length

    def cache_shape(self):
        return 1, 1, 1

    @contextlib.contextmanager
    def use_cache(self, cache):
        self._cache = cache
        try:
            yield cache
        finally:
            self._cache = None

    def forward(self, tokens, position_ids, attention_mask, logits_start=0, attention_pattern=None):
        B, T = tokens.shape
        keys = position_ids
        if self._cache is not None:
            c = self._cache
            kv = position_ids.float()[:, None, :, None]
            c.attend(0, kv, kv, kv, attention_mask[:, None])
            keys = torch.cat([c.window(0)[0][:, 0, :, 0].long(), position_ids], 1)
        seen = [[sorted(set(keys[b][attention_mask[b, r]].tolist())) for r in range(T)] for b in range(B)]
        self.calls.append({"tokens": tokens.tolist(), "positions": position_ids.tolist(), "seen": seen,
                           "cached": self._cache is not None})
        pos = position_ids[:, logits_start:].clamp(max=self.table.shape[0] - 1)
        return self.table[pos]


def peaked(rows: list[list[tuple[int, float]]], vocab: int, floor: float = -4.0) -> torch.Tensor:
    """A logits table: row p puts logit v on token t for each (t, v) of rows[p], ``floor`` elsewhere."""
    table = torch.full((len(rows), vocab), floor)
    for p, row in enumerate(rows):
        for t, v in row:
            table[p, t] = v
    return table


class Shifted:
    """A model trained with ``shift_logits`` (the samplers read the attribute); everything else delegated."""

    shift_logits = True

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kw):
        return self.model(*args, **kw)


__all__ = ["ScriptedModel", "peaked", "Shifted"]
