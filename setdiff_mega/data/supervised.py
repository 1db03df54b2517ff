"""Supervised samples (``data.format=sft``): one conversation per length-L row, right-padded, the reference's
layout (its ``DenoisingCollator`` pads to ``max_length``).

Sample i of a split is conversation ``docs[i]`` of a dataset written by :mod:`.sft`:

    tokens   [L] long   the conversation's tokens, then PAD
    context  [L] bool   its non-target tokens (the prompt, the template's markup, earlier user turns): visible,
                        pinned first in a diffusion order, never in the loss
    padding  [L] bool   the positions past its end (never attended, never scored)

With ``data.packing`` the split's conversations are packed several to a row instead (:mod:`.packing`).
Conversations longer than L follow ``data.sft_overlong``: ``truncate`` keeps the first L tokens (one whose
first L tokens hold no target is dropped: it could teach nothing), ``drop`` leaves them out, ``error`` stops
with the first one's index and length. Splits: ``data.split`` weights over the conversations in file order
(megatron-core's split rule over documents), each split in an order shuffled once with ``data.seed``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset

from .indexed import DataError, check_dataset, read_manifest
from .packing import PackedConversations
from .sft import target_prefix

OVERLONG = ("truncate", "drop", "error")


class PaddedConversations:
    """A :class:`~setdiff_mega.data.batch.SampleSource` of padded conversations (module docstring)."""

    def __init__(self, prefix: str | Path, docs: np.ndarray, seq_length: int, pad_id: int):
        self.tokens = IndexedDataset(str(prefix), mmap=True)
        self.targets = IndexedDataset(target_prefix(prefix), mmap=True)
        self.docs, self.L, self.pad = np.asarray(docs, dtype=np.int64), int(seq_length), int(pad_id)

    def __len__(self) -> int:
        return len(self.docs)

    def lengths(self) -> np.ndarray:
        """[n] the samples' conversation lengths (at most L: the truncated ones count L)."""
        return np.minimum(np.asarray(self.tokens.sequence_lengths)[self.docs], self.L)

    def conversation(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample i's conversation (its first L tokens): (token ids [n] int64, target mask [n] bool)."""
        d = int(self.docs[i])
        return (np.asarray(self.tokens[d][: self.L], dtype=np.int64),
                np.asarray(self.targets[d][: self.L], dtype=bool))

    def __getitem__(self, i: int) -> dict:
        ids, tgt = self.conversation(i)
        n = ids.size
        tokens = np.full(self.L, self.pad, dtype=np.int64)
        tokens[:n] = ids
        padding = np.arange(self.L) >= n
        context = np.zeros(self.L, dtype=bool)
        context[:n] = ~tgt
        return {"tokens": tokens, "context": context, "padding": padding}


def _usable(prefix, lengths: np.ndarray, L: int, overlong: str) -> np.ndarray:
    """[n] bool: the conversations a split may use under ``overlong``."""
    long = lengths > L
    if overlong == "error" and long.any():
        i = int(np.argmax(long))
        raise DataError(f"conversation {i} of '{prefix}' has {int(lengths[i])} tokens, more than data.seq_length={L}"
                        f" ({int(long.sum())} such); raise data.seq_length, or set data.sft_overlong=truncate|drop")
    if overlong == "drop":
        return ~long
    targets = IndexedDataset(target_prefix(prefix), mmap=True)
    ok = np.ones(len(lengths), dtype=bool)
    for i in np.flatnonzero(long):           # truncated: is a target left in the first L tokens?
        ok[i] = bool(np.asarray(targets[int(i)][:L]).any())
    return ok


def build_sft_splits(prefix: str, tokenizer, seq_length: int, split: str, seed: int, overlong: str = "truncate",
                     check_tokenizer: bool = True, needed: tuple = ("train", "valid"), log=print,
                     packing: bool = False):
    """(train, valid, test) :class:`PaddedConversations` (None for a weight-0 split) of one supervised dataset;
    with ``packing``, :class:`~.packing.PackedConversations` of them."""
    if overlong not in OVERLONG:
        raise DataError(f"data.sft_overlong={overlong!r} is not one of {', '.join(OVERLONG)}")
    if len(str(prefix).split()) > 1:
        raise DataError(f"data.path={prefix!r}: supervised data is read from one dataset (no blends); preprocess "
                        f"all the inputs into one (tools/preprocess_data.py --sft --input a.jsonl b.jsonl ...)")
    check_dataset(prefix, tokenizer.vocab_size, tokenizer=tokenizer if check_tokenizer else None)
    manifest = read_manifest(prefix) or {}
    if manifest.get("kind") != "sft" or not Path(f"{target_prefix(prefix)}.idx").is_file():
        raise DataError(f"'{prefix}' is not supervised data (no target mask '{target_prefix(prefix)}.idx'); make it "
                        f"with tools/preprocess_data.py --sft, or train on it with data.format=pretrain")
    ds = IndexedDataset(str(prefix), mmap=True)
    lengths = np.array(ds.sequence_lengths, dtype=np.int64)          # a copy: the map closes with ``ds``
    del ds
    n = len(lengths)
    usable = _usable(prefix, lengths, seq_length, overlong)
    if (~usable).any():
        log(f"note: {int((~usable).sum())} of {n} conversations of '{prefix}' are longer than data.seq_length="
            f"{seq_length} and left out (data.sft_overlong={overlong})")
    out = []
    for k, bounds in enumerate(convert_split_vector_to_split_matrix(parse_and_normalize_split(split))):
        if bounds is None:
            out.append(None)
            continue
        beg, end = int(round(bounds[0] * n)), int(round(bounds[1] * n))
        docs = np.arange(beg, end)[usable[beg:end]]
        name = ("train", "valid", "test")[k]
        if docs.size == 0 and name in needed:
            raise DataError(f"the {name} split of '{prefix}' (data.split={split!r}) holds no usable conversation of "
                            f"its {n}; use more data or give the {name} split more weight")
        docs = np.random.default_rng([seed, k]).permutation(docs)
        padded = PaddedConversations(prefix, docs, seq_length, tokenizer.pad) if docs.size else None
        out.append(PackedConversations(padded, seed + k) if padded is not None and packing else padded)
    if packing and out[0] is not None:
        log(f"packing: {len(out[0].lengths)} train conversations in {len(out[0])} samples of {seq_length} tokens "
            f"({100 * out[0].fill():.1f}% tokens, {100 * (1 - out[0].fill()):.1f}% padding)")
    return tuple(out)


__all__ = ["PaddedConversations", "build_sft_splits", "OVERLONG"]
