"""The one way from a :class:`~setdiff_mega.data.batch.Batch` to model inputs (:func:`inputs_for`), used by
training, validation, likelihood, the memory estimate and the benchmarks.

Row i's noise comes from :func:`row_generator` (the row's seed, its sample id), so the inputs of a sample do not
depend on which rank, batch or step reads it (layout-independent training, exact resumes). In a packed batch
(``Batch.document_ids``) every document gets the generator of its own id instead, and the row is assembled by
:func:`~.packing.packed_row_inputs` (each document exactly as its padded sample).
"""
from __future__ import annotations

import torch

from setdiff_mega.data.batch import Batch

from .base import ModelInputs, Objective, collate_inputs
from .packing import packed_row_inputs


def row_generator(seed: int, sample_id: int, device) -> torch.Generator:
    """The noise generator of one row (or packed document): seeded by (seed, its sample id) only."""
    return torch.Generator(device=device).manual_seed((int(seed) * 1_000_003 + int(sample_id)) % (2 ** 63))


def inputs_for(objective: Objective, batch: Batch, seed, training: bool = True) -> ModelInputs:
    """Model inputs of ``batch`` (module docstring); its context and padding reach the objective. ``seed``: one
    for every row, or a list of one per row (training: the row's noise epoch, which can change inside a
    micro-batch that wraps around)."""
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * batch.rows
    dev = batch.tokens.device
    parts = []
    for i, sid in enumerate(batch.sample_ids):
        row = lambda t: None if t is None else t[i:i + 1]  # noqa: E731
        if batch.document_ids is not None:
            parts.append(packed_row_inputs(objective, batch.tokens[i], None if batch.context is None else
                                           batch.context[i], None if batch.padding is None else batch.padding[i],
                                           batch.document_ids[i], lambda d, s=seeds[i]: row_generator(s, d, dev),
                                           training))
            continue
        parts.append(objective.build_inputs(batch.tokens[i:i + 1], context=row(batch.context),
                                            padding=row(batch.padding), generator=row_generator(seeds[i], sid, dev),
                                            training=training))
    return collate_inputs(parts)


def build_inputs_per_sample(objective: Objective, tokens: torch.Tensor, sample_ids, seed: int,
                            training: bool = True) -> ModelInputs:
    """:func:`inputs_for` of plain token rows (no context, no padding)."""
    return inputs_for(objective, Batch(tokens, list(sample_ids)), seed, training)


__all__ = ["inputs_for", "row_generator", "build_inputs_per_sample"]
