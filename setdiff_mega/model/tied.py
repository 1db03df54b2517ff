"""Tied embeddings across pipeline stages, by megatron-core's protocol (``LanguageModule``).

With ``tie_embeddings`` and PP > 1 the embedding E [V_pad / TP, H] lives on the first stage and the head on
the last, so the last stage keeps a *copy* of E as its head weight (the parameter attributes megatron-core
uses: ``shared`` and ``shared_embedding`` on the copy, ``shared_embedding`` on E):

* build: the copy is zeroed and all-reduced (sum) with E over the embedding group (first and last stage
  ranks of the same TP / DP position), so both start equal (:func:`sync_tied_copies`);
* every step: the two gradients are summed over that group before clipping and the update
  (:func:`allreduce_tied_grads`): dL/dE = the embedding's part + the head's part, as in one process, and
  identical updates keep the copies identical;
* the gradient norm and the parameter count skip the copy (``shared``), so both equal the single-process
  values;
* checkpoints: the copy is stored under E's key as a replica (:func:`tie_checkpoint_entry`), so it is
  never written twice and loads from E in any layout.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint


def mark_stage_weights(module) -> None:
    """Set the attributes of a tied chunk's stage weight (see the module docstring)."""
    w = stage_tied_weight(module)
    if w is None:
        return
    w.shared_embedding = True
    if not module.pre_process:
        w.shared = True


def stage_tied_weight(module):
    """The chunk's side of a tie split over stages: E on the first stage, the copy on the last, else None."""
    if not module.tie_embeddings or (module.pre_process and module.post_process):
        return None
    if module.pre_process:
        return module.embedding.word_embeddings.weight
    if module.post_process:
        return module.output_layer.weight
    return None


def tied_weights(chunks) -> list:
    return [w for w in (stage_tied_weight(c) for c in chunks) if w is not None]


@torch.no_grad()
def sync_tied_copies(chunks) -> None:
    """Collective over the embedding group: the last stage's copy := the first stage's E."""
    for w in tied_weights(chunks):
        if getattr(w, "shared", False):
            w.zero_()
        dist.all_reduce(w.data, group=ps.get_embedding_group())


def allreduce_tied_grads(weights) -> None:
    """Sum the gradients of E and its copy (``weights``: :func:`tied_weights`) over the embedding group (both
    hold the sum afterwards)."""
    for w in weights:
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=ps.get_embedding_group())


def tie_checkpoint_entry(module, ssd: dict, prefix: str, metadata: dict | None) -> dict:
    """A last stage's sharded state dict with its copy stored as a replica of E (megatron-core's
    ``tie_embeddings_and_output_weights_state_dict``)."""
    w = stage_tied_weight(module)
    if w is None or module.pre_process:
        return ssd
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    del ssd[f"{prefix}output_layer.weight"]
    ssd[f"{prefix}output_layer.weight"] = make_tp_sharded_tensor_for_checkpoint(
        tensor=w, key=f"{prefix}embedding.word_embeddings.weight",
        replica_id=(1, 0, ps.get_data_parallel_rank(with_context_parallel=True)), allow_shape_mismatch=True,
        tp_group=ps.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])
    return ssd


__all__ = ["mark_stage_weights", "stage_tied_weight", "tied_weights", "sync_tied_copies", "allreduce_tied_grads",
           "tie_checkpoint_entry"]
