"""Packed supervised samples (``data.format=sft`` with ``data.packing=true``): several conversations per
length-L row, placed first-fit by decreasing length, none split.

The conversations of a split (``docs``: the same shuffled order as :class:`~.supervised.PaddedConversations`,
whose sample j is conversation ``docs[j]``) are sorted by length, longest first (ties in split order), and
each goes into the first pack with room for it (first-fit decreasing: at most 11/9 OPT + 1 packs); the packs
are then shuffled once with ``data.seed``. Sample i is pack i:

    tokens        [L] long   its conversations one after another, then PAD
    context       [L] bool   each conversation's non-target tokens (visible, first in its own order, no loss)
    padding       [L] bool   the positions after the last conversation
    document_ids  [L] long   each position's conversation as its padded sample index j (-1 on padding): its
                             noise is the padded sample's, so a conversation trains on the same inputs packed
                             or padded (:mod:`setdiff_mega.diffusion.packing`)

``documents(i)`` is the number of conversations in pack i (the trainer's per-document loss denominator).
Conversations longer than L were truncated (or dropped) by the split's ``data.sft_overlong`` policy before
packing; a truncated one fills a pack of its own. The first-fit search is a max segment tree over the
packs' free room: O(n log n) for n conversations.
"""
from __future__ import annotations

import numpy as np


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of indices into ``lengths``) of total length <= ``capacity``: each length, longest first
    (stable), into the first bin it fits (a bin is opened when none has room)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"lengths must be in [1, {capacity}], got {int(lengths.min())}..{int(lengths.max())}")
    size = 1
    while size < max(n, 1):
        size *= 2
    room = [capacity] * (2 * size)        # max free room per subtree; unopened bins are empty (full room)
    bins: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        need, node = int(lengths[i]), 1
        while node < size:                # the leftmost leaf with room >= need
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        leaf = node - size
        if leaf == len(bins):
            bins.append([])
        bins[leaf].append(i)
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


class PackedConversations:
    """A :class:`~setdiff_mega.data.batch.SampleSource` of packed conversations (module docstring)."""

    def __init__(self, padded, seed: int):
        """``padded``: the split's :class:`~.supervised.PaddedConversations` (or any source with ``L``, ``pad``,
        ``lengths()`` [n] and ``conversation(j)`` -> (ids, target mask)): its conversations, in its order."""
        self.padded, self.L = padded, padded.L
        lengths = np.asarray(padded.lengths(), dtype=np.int64)
        packs = first_fit_decreasing(lengths, self.L)
        order = np.random.default_rng([int(seed), 7]).permutation(len(packs))
        self.packs = [packs[k] for k in order]
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.packs)

    def documents(self, i: int) -> int:
        """The number of conversations in sample i."""
        return len(self.packs[i])

    def fill(self) -> float:
        """The fraction of the packs' positions that hold tokens (not padding)."""
        return float(self.lengths.sum()) / max(len(self.packs) * self.L, 1)

    def __getitem__(self, i: int) -> dict:
        L = self.L
        tokens = np.full(L, self.padded.pad, dtype=np.int64)
        context = np.zeros(L, dtype=bool)
        document_ids = np.full(L, -1, dtype=np.int64)
        o = 0
        for j in self.packs[i]:
            ids, tgt = self.padded.conversation(j)
            n = ids.size
            tokens[o:o + n], context[o:o + n], document_ids[o:o + n] = ids, ~tgt, j
            o += n
        return {"tokens": tokens, "context": context, "padding": np.arange(L) >= o, "document_ids": document_ids}


__all__ = ["PackedConversations", "first_fit_decreasing"]
