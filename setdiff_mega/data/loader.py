"""Training batches from indexed data through megatron-core's GPTDataset (document packing).

``build_splits`` builds train / valid / test ``GPTDataset`` objects with
``BlendedMegatronDatasetBuilder`` (documents split by ``data.split`` weights, packed into length-L
samples, shuffled with ``data.seed``, index files cached in ``cache_dir``; under torch.distributed
rank 0 writes the cache first and the other ranks read it). Each sample is exactly L
clean tokens (``add_extra_token_to_sequence=False``): objectives do their own shifting or noising.

``batches(dataset, batch_size, start_sample, stride)`` yields ``{"tokens": [B, L] long,
"sample_index": int}`` in a deterministic order that resumes exactly from a number of consumed samples
(it wraps around the epoch if more samples are asked for than the dataset holds).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from .indexed import DataError, check_dataset


def build_splits(prefix: str, tokenizer, seq_length: int, split: str, seed: int,
                 num_samples: tuple[int, int, int], cache_dir: str | None = None):
    """Return (train, valid, test) GPTDatasets (valid/test may be None when their weight is 0)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    info = check_dataset(prefix, tokenizer.vocab_size)
    cache = cache_dir or str(Path(prefix).parent / "cache")
    cfg = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([str(prefix)], None), split=split,
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
                        f"({info['num_tokens']} tokens, split {split}): {type(e).__name__}: {e}") from e
    if train is None or len(train) == 0:
        raise DataError(f"dataset '{prefix}' yields no training samples of length {seq_length}; "
                        f"use more data or a shorter data.seq_length")
    return train, valid, test


def batches(dataset, batch_size: int, start_sample: int = 0, stride: int | None = None) -> Iterator[dict]:
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
        yield {"tokens": tokens, "sample_index": i}
        i += stride


__all__ = ["build_splits", "batches"]
