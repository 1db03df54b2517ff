"""Exponential moving average of the weights (``train.ema_decay``; the reference's Composer EMA).

After every optimizer step, in fp32 whatever the parameter dtype:

    ema <- ema + (1 - d) (w - ema)          (torch._foreach_lerp_; the reference: smoothing 0.9999)

Each rank keeps the EMA of the parameter storage it owns: its TP / PP shards, the full (replicated)
parameters under DDP and ZeRO-1/2, and only its partition ``p.ds_tensor`` [ceil(n / DP)] of each
flattened, zero-padded parameter under ZeRO-3. Checkpoints store the EMA like the weights: a second
megatron-core sharded state dict whose keys carry the prefix ``ema.`` (``ema.decoder.layers.0...``),
built from the model's own sharded state dict with the EMA tensors in place of the parameters, so it
reshards into any (TP, PP, DP) layout exactly as the weights do (ZeRO-3 partitions are gathered over the
data-parallel group for the save and sliced again on load). :meth:`EMA.swapped` runs code with the EMA
in the model (evaluation), restoring the raw weights afterwards.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from setdiff_mega.checkpoint.sharded import EMA_PREFIX as PREFIX
from setdiff_mega.checkpoint.sharded import has_ema  # noqa: F401  (re-exported)
from setdiff_mega.parallel.zero import import_deepspeed


def _zero3(p) -> bool:
    return hasattr(p, "ds_tensor")


def _dp():
    return ps.get_data_parallel_group(), ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()


class EMA:
    def __init__(self, model, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay={decay} must be in (0, 1) (0 turns the EMA off)")
        self.model, self.decay = model, float(decay)
        self.params = list(model.parameters())
        self.shadow = [self._storage(p).detach().float().clone() for p in self.params]

    @staticmethod
    def _storage(p) -> torch.Tensor:
        """The tensor this rank updates: the parameter, or its ZeRO-3 partition."""
        return p.ds_tensor if _zero3(p) else p.data

    @torch.no_grad()
    def update(self) -> None:
        current = [self._storage(p).float() for p in self.params]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)

    # -- full tensors (ZeRO-3: gathered / sliced over the data-parallel group) -------------------------
    def _full(self, p, shadow: torch.Tensor) -> torch.Tensor:
        if not _zero3(p):
            return shadow

        group, world, _ = _dp()
        parts = [torch.empty_like(shadow) for _ in range(world)]
        dist.all_gather(parts, shadow, group=group)
        return torch.cat(parts)[:p.ds_numel].view(p.ds_shape)

    def _set_from_full(self, p, shadow: torch.Tensor, full: torch.Tensor) -> None:
        if not _zero3(p):
            shadow.copy_(full)
            return
        _, _, rank = _dp()
        n = shadow.numel()
        flat = torch.zeros(n * (rank + 1), dtype=shadow.dtype, device=shadow.device)
        src = full.reshape(-1)[: n * (rank + 1)]
        flat[: src.numel()] = src
        shadow.copy_(flat[n * rank:])

    # -- checkpoints ----------------------------------------------------------------------------------
    def sharded_state_dict(self) -> tuple[dict, list]:
        """(ssd with keys ``ema.*`` whose tensors are the EMA, [(ssd leaf, param, shadow)] for loading)."""
        by_param = {id(p): (p, s) for p, s in zip(self.params, self.shadow)}
        leaves = []

        def swap(v):
            if isinstance(v, dict):
                return {k: swap(x) for k, x in v.items()}
            if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and id(v.data) in by_param:
                p, s = by_param[id(v.data)]
                full = self._full(p, s)
                extra = {"dtype": full.dtype} if isinstance(v, ShardedTensor) else {}
                new = dataclasses.replace(v, data=full, **extra)
                leaves.append((new, p, s, full))
                return new
            return v

        gathered = _gathered_params(self.params)
        with gathered:
            ssd = swap(self.model.sharded_state_dict(prefix=PREFIX))
        return ssd, leaves

    def load(self, loaded: dict, leaves: list, request: dict) -> None:
        """Copy what ``dist_checkpointing.load`` returned for ``request`` (the first item of
        :meth:`sharded_state_dict`) into the EMA tensors."""
        flat_req, flat_out = _flatten(request), _flatten(loaded)
        where = {id(leaf): path for path, leaf in flat_req.items()}
        for leaf, p, s, full in leaves:
            value = flat_out[where[id(leaf)]]
            self._set_from_full(p, s, value if value is full else full.copy_(value))

    # -- evaluation with the EMA in the model -------------------------------------------------------------
    @contextlib.contextmanager
    def swapped(self):
        """The EMA (cast to each parameter's dtype) in the model; the raw weights come back afterwards."""
        raw = [self._storage(p).detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                for p, s in zip(self.params, self.shadow):
                    self._storage(p).copy_(s)
            yield self.model
        finally:
            with torch.no_grad():
                for p, r in zip(self.params, raw):
                    self._storage(p).copy_(r)


def _gathered_params(params):
    """ZeRO-3: the full parameters for the duration (the sharded state dict reads their shapes), unless
    the caller has gathered them already."""
    part = [p for p in params if _zero3(p)]
    if not part:
        return contextlib.nullcontext()

    ds = import_deepspeed()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # gated: ZeRO-3 only

    if all(p.ds_status == ZeroParamStatus.AVAILABLE for p in part):
        return contextlib.nullcontext()
    return ds.zero.GatheredParameters(part)


def _flatten(tree, path=()) -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, path + (k,)))
        return out
    return {path: tree}


__all__ = ["EMA", "PREFIX", "has_ema"]
