"""A typed batch of samples and the dataset protocol that yields it.

:class:`Batch` is what every consumer of data sees (training, validation, likelihood, the memory
estimate, the benchmarks), and :func:`setdiff_mega.diffusion.inputs_for` is the one way from a batch to
model inputs:

    tokens        [B, L] long   clean tokens
    sample_ids    B ints        each row's index in its dataset: the row's noise is seeded by it, so a
                                sample's inputs do not depend on which rank, batch or step reads it
    sample_index  int           the stream position of the first row (the noise epoch of a wrapping stream)
    context       [B, L] bool   prompt tokens: visible, pinned first in the generation order, never in the
                                loss (None: none)
    padding       [B, L] bool   right padding (None: none)
    document_ids  [B, L] long   packed samples: the document of each position (attention stays within a
                                document; None: one document per row)

A :class:`SampleSource` is anything with ``len()`` whose item ``i`` is a mapping with ``"tokens"`` [L] and
optionally ``"context"``, ``"padding"`` and ``"document_ids"`` [L]: megatron-core's ``GPTDataset`` /
``BlendedDataset`` (pretraining: tokens only) implement it today; supervised (prompt / response, packed)
data implements the optional fields. :func:`batches` turns a source into a deterministic, resumable
stream of batches.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Protocol

import torch


class SampleSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict: ...


@dataclass
class Batch:
    tokens: torch.Tensor
    sample_ids: list
    sample_index: int = 0
    context: torch.Tensor | None = None
    padding: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    def row_slice(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop) as a batch of their own (their noise is unchanged: it follows the sample ids)."""
        cut = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return replace(self, tokens=self.tokens[start:stop], sample_ids=list(self.sample_ids[start:stop]),
                       sample_index=self.sample_index + start, context=cut(self.context),
                       padding=cut(self.padding), document_ids=cut(self.document_ids))


OPTIONAL = ("context", "padding", "document_ids")


def collate(samples: list[dict], sample_ids: list, sample_index: int = 0,
            bos_eos: tuple[int, int] | None = None) -> Batch:
    """Samples of a :class:`SampleSource` -> a :class:`Batch`; ``bos_eos`` forces BOS first and EOS last
    on every row (the "wrap" convention of pretraining chunks)."""
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    if bos_eos is not None:
        tokens[:, 0], tokens[:, -1] = bos_eos
    extra = {}
    for key in OPTIONAL:
        if any(key in s for s in samples):
            dtype = torch.long if key == "document_ids" else torch.bool
            extra[key] = torch.stack([torch.as_tensor(s[key]) for s in samples]).to(dtype)
    return Batch(tokens, list(sample_ids), sample_index, **extra)


def batches(dataset: SampleSource, batch_size: int, start_sample: int = 0, stride: int | None = None,
            bos_eos: tuple[int, int] | None = None) -> Iterator[Batch]:
    """Deterministic, resumable stream of [B, L] batches.

    Batch k holds samples ``start_sample + k * stride + [0, batch_size)`` (``stride`` defaults to
    ``batch_size``), wrapping around the dataset. Data-parallel rank r of D uses ``start_sample = r *
    batch_size`` and ``stride = D * batch_size``, so the ranks together read the same samples as one
    process would.
    """
    n = len(dataset)
    stride = batch_size if stride is None else stride
    i = start_sample
    while True:
        idx = [(i + j) % n for j in range(batch_size)]
        yield collate([dataset[k] for k in idx], idx, i, bos_eos)
        i += stride


__all__ = ["Batch", "SampleSource", "collate", "batches", "OPTIONAL"]
