"""Re-initialise vocabulary rows of a loaded model: a token's embedding row (and output-head row and bias) := the
mean of the rows of the other tokens of the tokenizer's vocabulary (``train.init_mask_row=mean``, method.md 15).

What Hugging Face's ``resize_token_embeddings`` does for a new token, for a token the checkpoint has but never saw
as an input: an AR model's MASK row was initialised at random and, with tied embeddings, only ever pushed away
from every hidden state by the softmax. Rows are vocabulary-parallel (``[V_pad / TP, H]`` per TP rank, global rows
``[start, start + V_pad / TP)``): each rank sums the rows it holds of tokens ``[0, n_vocab)`` other than ``ids``,
the sums and counts are all-reduced over the TP group, and the rank holding a row writes the mean. Every chunk
holding the embedding (first stage) or an untied head (last stage) does so; a tied head on another stage (PP > 1)
is the embedding's copy, reset the same way from the same values, so the two stay equal.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def _matrices(chunk) -> list:
    """(weight [V_pad / TP, H], bias [V_pad / TP] or None) of the vocabulary rows this chunk holds."""
    out = []
    if chunk.pre_process:
        out.append((chunk.embedding.word_embeddings.weight, None))
    if chunk.post_process:
        head = chunk.output_layer
        if not (chunk.tie_embeddings and chunk.pre_process):      # else it is the embedding itself
            out.append((head.weight, getattr(head, "bias", None)))
        elif getattr(head, "bias", None) is not None:
            out.append((None, head.bias))
    return out


@torch.no_grad()
def _mean_rows(t: torch.Tensor, ids: list[int], n_vocab: int) -> None:
    """Rows ``ids`` of the vocabulary-parallel tensor ``t`` [V_pad / TP, ...] := the mean of rows [0, n_vocab)
    except ``ids`` (over the TP group)."""
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
    n_local = t.shape[0]
    start = rank * n_local
    rows = torch.arange(start, start + n_local, device=t.device)
    keep = (rows < n_vocab) & ~torch.isin(rows, torch.tensor(ids, device=t.device))
    total = torch.cat([t[keep].double().sum(0).reshape(-1), keep.sum().double().reshape(1)])
    if tp > 1:
        dist.all_reduce(total, group=ps.get_tensor_model_parallel_group())
    mean = (total[:-1] / total[-1].clamp(min=1)).reshape(t.shape[1:]).to(t.dtype)
    for i in ids:
        if start <= i < start + n_local:
            t[i - start] = mean


def mean_token_rows(chunks, ids: list[int], n_vocab: int) -> None:
    """Set the rows of tokens ``ids`` to the mean of the other tokens' rows in every chunk (module docstring)."""
    for chunk in chunks:
        for weight, bias in _matrices(chunk):
            for t in (weight, bias):
                if t is not None:
                    _mean_rows(t, list(ids), n_vocab)


__all__ = ["mean_token_rows"]
