"""Training batches from indexed data through megatron-core's GPTDataset (document packing).

``build_splits`` builds train / valid / test ``GPTDataset`` objects with
``BlendedMegatronDatasetBuilder`` (documents split by ``data.split`` weights, packed into length-L
samples, shuffled with ``data.seed``, index files cached in ``cache_dir``; under torch.distributed
rank 0 writes the cache first and the other ranks read it). Each sample is exactly L
clean tokens (``add_extra_token_to_sequence=False``): objectives do their own shifting or noising.

``data.path`` may be a blend, ``"0.7 data/a/corpus 0.3 data/b/corpus"`` (megatron-core's
BlendedDataset, weights respected per sample). ``batches(dataset, batch_size, start_sample, stride)`` yields ``{"tokens": [B, L] long,
"sample_index": int}`` in a deterministic order that resumes exactly from a number of consumed samples
(it wraps around the epoch if more samples are asked for than the dataset holds).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from .indexed import DataError, check_dataset


def parse_blend(path: str) -> tuple[list[str], list[float] | None]:
    """'data/a/corpus' -> ([prefix], None); '0.7 data/a/corpus 0.3 data/b/corpus' -> (prefixes, weights)."""
    parts = str(path).split()
    if len(parts) == 1:
        return parts, None
    if len(parts) % 2:
        raise DataError(f"data.path={path!r}: a blend is 'weight prefix weight prefix ...' (got an odd count)")
    try:
        weights = [float(w) for w in parts[0::2]]
    except ValueError:
        raise DataError(f"data.path={path!r}: a blend is 'weight prefix weight prefix ...'") from None
    if any(w <= 0 for w in weights):
        raise DataError(f"data.path={path!r}: blend weights must be positive")
    return parts[1::2], weights


def build_splits(prefix: str, tokenizer, seq_length: int, split: str, seed: int,
                 num_samples: tuple[int, int, int], cache_dir: str | None = None, check_tokenizer: bool = True):
    """Return (train, valid, test) datasets (valid/test may be None when their weight is 0).

    ``prefix`` is one dataset prefix or a blend string; blends come back as megatron-core
    ``BlendedDataset`` objects that draw from each dataset in proportion to its weight. Each prefix is
    checked first (``check_dataset``): its vocabulary and, with ``check_tokenizer``, that it was made with
    ``tokenizer``.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes, weights = parse_blend(prefix)
    n_tokens = sum(check_dataset(p, tokenizer.vocab_size, tokenizer=tokenizer if check_tokenizer else None)
                   ["num_tokens"] for p in prefixes)
    cache = cache_dir or str(Path(prefixes[0]).parent / "cache")
    cfg = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, weights), split=split,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, add_extra_token_to_sequence=False, tokenizer=tokenizer,
        path_to_cache=cache, mid_level_dataset_surplus=0.005)
    import torch.distributed as dist

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
    """(BOS, EOS) forced onto every sample under ``data.chunk_bos_eos`` (the "wrap" convention), else None."""
    return (tokenizer.bos, tokenizer.eos) if data_cfg.chunk_bos_eos else None


def batches(dataset, batch_size: int, start_sample: int = 0, stride: int | None = None,
            bos_eos: tuple[int, int] | None = None) -> Iterator[dict]:
    """Deterministic, resumable stream of [B, L] token batches.

    Batch k holds samples ``start_sample + k * stride + [0, batch_size)`` (``stride`` defaults to
    ``batch_size``). Data-parallel rank r of D uses ``start_sample = r * batch_size`` and
    ``stride = D * batch_size``, so the ranks together read the same samples as one process would.
    """
    n = len(dataset)
    stride = batch_size if stride is None else stride
    i = start_sample
    while True:
        idx = [(i + j) % n for j in range(batch_size)]
        tokens = torch.stack([torch.as_tensor(dataset[k]["tokens"]) for k in idx]).long()
        if bos_eos is not None:              # "wrap" convention with BOS/EOS insertion on every chunk
            tokens[:, 0], tokens[:, -1] = bos_eos
        yield {"tokens": tokens, "sample_index": i, "sample_ids": idx}
        i += stride


__all__ = ["build_splits", "batches", "wrap_ids"]
