"""Training batches from indexed data through megatron-core's GPTDataset (document packing), or supervised
conversations (``data.format=sft``: :mod:`.supervised`).

``build_splits`` builds train / valid / test ``GPTDataset`` objects with
``BlendedMegatronDatasetBuilder`` (documents split by ``data.split`` weights, packed into length-L
samples, shuffled with ``data.seed``, index files cached; under torch.distributed rank 0 writes the
cache first and the other ranks read it). Each sample is exactly L clean tokens
(``add_extra_token_to_sequence=False``): objectives do their own shifting or noising.

The index cache is keyed by content. megatron-core names its index files by the prefix's path and the
config, not by the data, so a dataset re-preprocessed under the same prefix would be read through the old
index (half the documents ignored, or an IndexError). The indices depend on the data only through the
``.idx`` (document and sequence lengths), so the cache lives in ``<cache_dir>/idx-<key>/`` with ``key``
from the SHA-256 of every prefix's ``.idx``; changed data gets a new directory, with a note naming the
prefix. Before megatron-core builds anything, every split the caller needs must hold at least one length-L
sample (megatron-core loops forever on an empty split); a split nobody reads that is too small is not
built.

``data.path`` may be a blend, ``"0.7 data/a/corpus 0.3 data/b/corpus"`` (megatron-core's
BlendedDataset, weights respected per sample). The datasets are :class:`~setdiff_mega.data.batch.SampleSource`
s: :func:`~setdiff_mega.data.batch.batches` streams them as typed batches in a deterministic order that
resumes exactly from a number of consumed samples.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from .batch import batches
from .blend import parse_blend
from .indexed import DataError, check_dataset, read_manifest, sha256_file
from .supervised import build_sft_splits

SPLITS = ("train", "valid", "test")


def split_sizes(prefix: str, split: str) -> list[tuple[int, int, int] | None]:
    """Per split (train, valid, test): (documents, tokens, of documents in all) exactly as megatron-core
    assigns them (its split matrix and rounding over the ``.idx`` sequences), None for a weight-0 split."""
    ds = IndexedDataset(str(prefix), mmap=True)
    lengths = np.array(ds.sequence_lengths, dtype=np.int64)      # a copy: the map closes with ``ds``
    del ds
    n = len(lengths)
    out = []
    for bounds in convert_split_vector_to_split_matrix(parse_and_normalize_split(split)):
        if bounds is None:
            out.append(None)
            continue
        beg, end = int(round(bounds[0] * float(n))), int(round(bounds[1] * float(n)))
        out.append((end - beg, int(lengths[beg:end].sum()), n))
    return out


def check_split_sizes(prefixes: list, split: str, seq_length: int, num_samples, needed) -> list:
    """Refuse (one DataError with the numbers) a needed split that holds less than one length-L sample in
    some prefix; returns the split indices to leave unbuilt (not needed and too small)."""
    skip = set()
    for p in prefixes:
        for i, size in enumerate(split_sizes(p, split)):
            if size is None or not num_samples[i] or size[1] >= seq_length:
                continue
            if SPLITS[i] not in needed:
                skip.add(i)
                continue
            docs, toks, n = size
            raise DataError(f"dataset '{p}' is too small for data.split={split!r} and data.seq_length={seq_length}: "
                            f"its {SPLITS[i]} split gets {docs} of its {n} documents ({toks} tokens), less than one "
                            f"length-{seq_length} sample; use more data, a shorter data.seq_length, or a data.split "
                            f"that gives the {SPLITS[i]} split more weight")
    return sorted(skip)


def index_cache(prefixes: list, base: str | Path, log=print) -> str:
    """The content-keyed cache directory of these prefixes' indices (created; a note when the data under a
    prefix changed since an earlier cache of it)."""
    digests = {str(Path(p).resolve()): sha256_file(Path(f"{p}.idx")) for p in prefixes}
    key = hashlib.sha256(json.dumps(sorted(digests.values())).encode()).hexdigest()[:16]
    base = Path(base)
    d = base / f"idx-{key}"
    if not (d / "sources.json").is_file():
        for other in sorted(base.glob("idx-*/sources.json")):
            try:
                seen = json.loads(other.read_text())
            except (OSError, ValueError):
                continue
            changed = [p for p, h in digests.items() if p in seen and seen[p] != h]
            if changed:
                log(f"note: '{changed[0]}' holds other data than when the index cache '{other.parent}' was built "
                    f"(its .idx changed): building a new index in '{d}'")
                break
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"sources.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(digests, indent=1))
        tmp.replace(d / "sources.json")
    return str(d)


def build_splits(prefix: str, tokenizer, seq_length: int, split: str, seed: int,
                 num_samples: tuple[int, int, int], cache_dir: str | None = None, check_tokenizer: bool = True,
                 needed: tuple = ("train", "valid"), log=print, fmt: str = "pretrain", overlong: str = "truncate",
                 packing: bool = False):
    """Return (train, valid, test) datasets (None for a weight-0 split, or one not ``needed`` and too small
    for a sample).

    ``prefix`` is one dataset prefix or a blend string; blends come back as megatron-core
    ``BlendedDataset`` objects that draw from each dataset in proportion to its weight. Each prefix is
    checked first (``check_dataset``): its vocabulary and, with ``check_tokenizer``, that it was made with
    ``tokenizer``; then every ``needed`` split must hold one length-``seq_length`` sample. ``fmt="sft"``:
    supervised conversations instead (:func:`~setdiff_mega.data.supervised.build_sft_splits`, ``overlong``,
    ``packing``).
    """
    if fmt == "sft":
        return build_sft_splits(prefix, tokenizer, seq_length, split, seed, overlong, check_tokenizer, needed, log,
                                packing)
    prefixes, weights = parse_blend(prefix)
    for p in prefixes:
        if (read_manifest(p) or {}).get("kind") == "sft":
            raise DataError(f"'{p}' is supervised data (conversations with a target mask): set data.format=sft")
    n_tokens = sum(check_dataset(p, tokenizer.vocab_size, tokenizer=tokenizer if check_tokenizer else None)
                   ["num_tokens"] for p in prefixes)
    skip = check_split_sizes(prefixes, split, seq_length, num_samples, needed)
    cache = index_cache(prefixes, cache_dir or Path(prefixes[0]).parent / "cache", log)
    cfg = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, weights), split=split,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, add_extra_token_to_sequence=False, tokenizer=tokenizer,
        path_to_cache=cache, mid_level_dataset_surplus=0.005)
    for i in skip:                           # read by nobody, and megatron-core would loop on it forever
        cfg.split_matrix[i] = None

    def build():
        return BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, cfg).build()

    try:
        if dist.is_initialized() and dist.get_world_size() > 1:
            # rank 0 writes the cached index files; the other ranks then load them (no write races)
            result = build() if dist.get_rank() == 0 else None
            dist.barrier()
            train, valid, test = result if result is not None else build()
        else:
            train, valid, test = build()
    except Exception as e:
        raise DataError(f"could not build length-{seq_length} samples from '{prefix}' "
                        f"({n_tokens} tokens, split {split}): {type(e).__name__}: {e}") from e
    if train is None or len(train) == 0:
        raise DataError(f"dataset '{prefix}' yields no training samples of length {seq_length}; "
                        f"use more data or a shorter data.seq_length")
    return train, valid, test


def wrap_ids(data_cfg, tokenizer) -> tuple[int, int] | None:
    """(BOS, EOS) forced onto every pretraining chunk under ``data.chunk_bos_eos`` (the "wrap" convention), else
    None (supervised conversations keep their own)."""
    return (tokenizer.bos, tokenizer.eos) if data_cfg.chunk_bos_eos and data_cfg.format != "sft" else None


__all__ = ["build_splits", "batches", "wrap_ids", "split_sizes", "check_split_sizes", "index_cache", "SPLITS"]
