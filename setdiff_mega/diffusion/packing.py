"""Model inputs of a packed row: several documents in one length-L row, each exactly as if it were alone.

A packed row (``Batch.document_ids`` [L]: each position's document id, -1 on padding; the documents one after
another, the padding last) becomes the inputs of its documents side by side:

1. document d at positions [o, o + n) is built by the objective as its own right-padded length-L row (its
   tokens then PAD, its context, padding after n), with its own generator (seeded by its id, as the padded
   sample of the same document is): its order, its t, its masked tokens and its positions 0..n-1 are the
   padded sample's. It is built with :meth:`~.base.Objective.patterns_only` (no dense mask).
2. Every objective's layout is slotted by stream: T = streams x T_s input positions; slot j of each stream
   and target j belong to the row's j-th slot (rank j for SetDLM), and a document's valid slots come first in
   each stream (padding is last in every order). So its slots [0, m) of every stream go to slots [o, o + m)
   of the packed row (m = n, or the slots that fit: AR has T_s = L - 1), and so do its targets, loss mask and
   weights; a target's logit row (``logit_rows``, relative to ``logits_start``; input position p = stream
   p // T_s, slot p % T_s) moves by the same offset, as does its next-token row (``ar_rows``, with ``ar_mask``
   copied like the loss mask); extras [1, N] are copied slot by slot (the ones holding
   positions, ``Objective.position_extras``, offset by o), scalar extras summed.
3. The mask is the objective's pattern restricted to the documents (:meth:`~.masks.MaskPattern.with_documents`:
   same document, blocks counted from each document's start), the padding tail invalid keys; ``groups`` [1, N]
   marks each target slot's document for the per-document loss.

So a document's logits and loss in a packed row equal those of its padded row (``tests/model/test_packing.py``);
positions restart at 0 in every document, and no document sees another's keys.
"""
from __future__ import annotations

import torch

from . import masks as M
from .base import ModelInputs, Objective
from .masks import document_runs


def _document_row(tokens: torch.Tensor, context: torch.Tensor | None, L: int, pad_id: int):
    """A document's n tokens [n] (and context [n]) as its own padded row: (tokens, context, padding) [1, L]."""
    n = tokens.shape[0]
    row = torch.full((1, L), pad_id, dtype=tokens.dtype, device=tokens.device)
    row[0, :n] = tokens
    ctx = torch.zeros(1, L, dtype=torch.bool, device=tokens.device)
    if context is not None:
        ctx[0, :n] = context
    return row, ctx, (torch.arange(L, device=tokens.device) >= n)[None]


def packed_row_inputs(objective: Objective, tokens: torch.Tensor, context: torch.Tensor | None,
                      padding: torch.Tensor | None, documents: torch.Tensor, generator_of,
                      training: bool = True) -> ModelInputs:
    """The inputs [1, ...] of one packed row (module docstring): ``tokens`` / ``context`` / ``padding`` /
    ``documents`` [L]; ``generator_of(document id)`` gives each document's noise generator."""
    L = tokens.shape[0]
    pad_id = int(tokens[padding][0]) if padding is not None and bool(padding.any()) else 0
    builder = objective.patterns_only()
    docs = []
    for d, o, e in document_runs(documents):
        row, ctx, pad = _document_row(tokens[o:e], None if context is None else context[o:e], L, pad_id)
        docs.append((d, o, e - o, builder.build_inputs(row, ctx, pad, generator_of(d), training)))
    return _assemble(objective, docs, pad_id)


def _assemble(objective: Objective, docs: list, pad_id: int) -> ModelInputs:
    """The packed row's inputs from its documents' (id, offset, length, inputs) (module docstring, 2 and 3)."""
    first = docs[0][3]
    T, N, dev = first.tokens.shape[1], first.targets.shape[1], first.tokens.device
    streams = 2 if objective.two_stream else 1
    Ts = T // streams
    if N != Ts or T % streams:
        raise ValueError(f"objective {objective.name!r} lays out {T} positions in {streams} stream(s) with {N} "
                         f"targets: not one target per stream slot, so it cannot pack documents")
    tokens = torch.full((1, T), pad_id, dtype=first.tokens.dtype, device=dev)
    position_ids = torch.zeros(1, T, dtype=first.position_ids.dtype, device=dev)
    doc_of = torch.full((1, T), -1, dtype=torch.long, device=dev)
    targets = torch.full((1, N), pad_id, dtype=first.targets.dtype, device=dev)
    loss_mask = torch.zeros(1, N, dtype=torch.bool, device=dev)
    groups = torch.full((1, N), -1, dtype=torch.long, device=dev)
    weights = None if first.weights is None else torch.zeros(1, N, dtype=first.weights.dtype, device=dev)
    rows = None if first.logit_rows is None else torch.arange(N, device=dev)[None].clone()
    ar_rows = None if first.ar_rows is None else torch.arange(N, device=dev)[None].clone()
    ar_mask = None if first.ar_mask is None else torch.zeros(1, N, dtype=torch.bool, device=dev)
    extras = _empty_extras(objective, first.extras, N, dev)
    for d, o, n, inp in docs:
        m = min(n, Ts - o)
        for s in range(streams):
            dst, src = slice(s * Ts + o, s * Ts + o + m), slice(s * Ts, s * Ts + m)
            tokens[0, dst], position_ids[0, dst], doc_of[0, dst] = inp.tokens[0, src], inp.position_ids[0, src], d
        targets[0, o:o + m], loss_mask[0, o:o + m], groups[0, o:o + m] = inp.targets[0, :m], inp.loss_mask[0, :m], d
        if weights is not None:
            weights[0, o:o + m] = inp.weights[0, :m]
        for out, own in ((rows, inp.logit_rows), (ar_rows, inp.ar_rows)):
            if out is not None:
                p = own[0, :m] + inp.logits_start                  # the input position each target reads
                out[0, o:o + m] = (p // Ts) * Ts + o + p % Ts - inp.logits_start
        if ar_mask is not None:
            ar_mask[0, o:o + m] = inp.ar_mask[0, :m]
        _copy_extras(objective, extras, inp.extras, o, m)
    valid = doc_of >= 0
    pattern = M.MaskPattern(first.attention_pattern.kind, T, first.attention_pattern.block_size)
    pattern = pattern.with_padding(None if bool(valid.all()) else valid).with_documents(doc_of)
    return ModelInputs(tokens=tokens, position_ids=position_ids,
                       attention_mask=pattern.dense(dev) if objective.dense_masks else None,
                       logits_start=first.logits_start, targets=targets, loss_mask=loss_mask, weights=weights,
                       extras=extras, attention_pattern=pattern, logit_rows=rows, groups=groups, ar_rows=ar_rows,
                       ar_mask=ar_mask)


def _empty_extras(objective: Objective, like: dict, N: int, dev) -> dict:
    """The packed row's extras before its documents are copied in: scalars 0, slot extras [1, N] zero (those
    holding positions: the identity, so a permutation stays one over the padding slots); others dropped."""
    out = {}
    for k, v in like.items():
        if not isinstance(v, torch.Tensor):
            continue
        if v.dim() == 0:
            out[k] = torch.zeros_like(v)
        elif v.shape == (1, N):
            out[k] = torch.arange(N, device=dev, dtype=v.dtype)[None].clone() if k in objective.position_extras \
                else torch.zeros_like(v)
    return out


def _copy_extras(objective: Objective, extras: dict, own: dict, o: int, m: int) -> None:
    for k, v in extras.items():
        if v.dim() == 0:
            extras[k] = v + own[k]
        else:
            extras[k][0, o:o + m] = own[k][0, :m] + (o if k in objective.position_extras else 0)


__all__ = ["packed_row_inputs", "document_runs"]
