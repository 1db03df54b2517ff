"""Gather a model-parallel model's weights into the single-process (TP = 1, PP = 1) state dict.

* TP: a parameter marked ``tensor_model_parallel`` is all-gathered over the TP group and concatenated
  along its ``partition_dim`` (column-parallel: rows; row-parallel: columns; vocab-parallel embedding:
  rows). SwiGLU's fused ``linear_fc1`` holds [gate_r ; up_r] on TP rank r, so its shards are regrouped as
  [gate_0 .. gate_{tp-1} ; up_0 .. up_{tp-1}], the TP = 1 layout.
* PP: stage s holds local layers 0..n-1 that are global layers s * n + i; names are rewritten to the
  global index and the stages' dicts are collected on global rank 0 (``all_gather_object`` over the
  pipeline group).

The result equals ``model.state_dict()`` of the same model built with TP = PP = 1, so checkpoints written
from any layout load with :func:`setdiff_mega.checkpoint.load_model` unchanged.
:func:`load_full_state_dict` is the inverse: it loads such a full state dict into any TP / PP layout.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist


def _tp_gather(t: torch.Tensor, dim: int, swiglu: bool, group, tp: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if swiglu:
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def gather_full_state_dict(model) -> dict | None:
    """Full single-process state dict on global rank 0 (None elsewhere); every rank must call it."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    state = model.state_dict()
    if tp == 1 and pp == 1:
        return state
    params = dict(model.named_parameters())
    swiglu = bool(model.config.gated_linear_unit)
    out = {}
    for name, t in state.items():
        p = params.get(name)
        if isinstance(t, torch.Tensor) and p is not None and getattr(p, "tensor_model_parallel", False) and tp > 1:
            t = _tp_gather(t.detach(), p.partition_dim, swiglu and "mlp.linear_fc1" in name,
                           ps.get_tensor_model_parallel_group(), tp)
        out[name] = t.detach().cpu() if isinstance(t, torch.Tensor) else t
    if pp > 1:
        per = len(model.decoder.layers)
        stage = ps.get_pipeline_model_parallel_rank()
        out = {re.sub(r"decoder\.layers\.(\d+)", lambda m: f"decoder.layers.{int(m.group(1)) + stage * per}", k): v
               for k, v in out.items()}
        stages = [None] * pp
        dist.all_gather_object(stages, out, group=ps.get_pipeline_model_parallel_group())
        out = {}
        for s in stages:
            out.update(s)
    return out if dist.get_rank() == 0 else None


def _global_names(model) -> dict:
    """local parameter / buffer name -> name in the single-process model."""
    from megatron.core import parallel_state as ps

    per = len(model.decoder.layers)
    stage = ps.get_pipeline_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    return {k: re.sub(r"decoder\.layers\.(\d+)", lambda m: f"decoder.layers.{int(m.group(1)) + stage * per}", k)
            for k in model.state_dict()}


def load_full_state_dict(model, full: dict, source: str = "checkpoint") -> None:
    """Load single-process weights ``full`` into this rank's TP shard / PP stage of ``model``."""
    from megatron.core import parallel_state as ps

    from .io import CheckpointError

    tp = ps.get_tensor_model_parallel_world_size()
    r = ps.get_tensor_model_parallel_rank()
    params = dict(model.named_parameters())
    swiglu = bool(model.config.gated_linear_unit)
    names = _global_names(model)
    local = {}
    for name, t in model.state_dict().items():
        g = names[name]
        if not isinstance(t, torch.Tensor):
            local[name] = full.get(g, t)
            continue
        if g not in full:
            raise CheckpointError(f"{source} has no tensor '{g}' (the model expects it): different architecture")
        src = full[g]
        p = params.get(name)
        if p is not None and getattr(p, "tensor_model_parallel", False) and tp > 1:
            dim = p.partition_dim
            if swiglu and "mlp.linear_fc1" in name:
                gate, up = src.chunk(2, dim=dim)
                src = torch.cat([gate.chunk(tp, dim=dim)[r], up.chunk(tp, dim=dim)[r]], dim=dim)
            else:
                src = src.chunk(tp, dim=dim)[r]
        if tuple(src.shape) != tuple(t.shape):
            raise CheckpointError(f"{source}: tensor '{g}' has shape {tuple(full[g].shape)}, which does not fit "
                                  f"this model (local shard {tuple(t.shape)} at TP={tp}): different model size or vocab")
        local[name] = src
    model.load_state_dict(local)


__all__ = ["gather_full_state_dict", "load_full_state_dict"]
