"""The optimizer backend: one object owns the gradients, the update and the optimizer's checkpoint.

Two implementations behind one interface, chosen by :func:`optimizer_backend` from ``train.zero_stage``:

* :class:`AdamWBackend` (``zero_stage=0``): the project's AdamW; under DP x CP > 1 megatron-core's DDP
  (:class:`~setdiff_mega.parallel.ddp.GradReducer`: bucketed, overlapped gradient averaging); clipping by the
  global norm over every TP / PP shard; its state saved with the weights through megatron-core's
  distributed checkpoint (any layout).
* :class:`ZeroBackend` (``zero_stage`` 1-3): a DeepSpeed ZeRO engine around the same AdamW; the engine owns
  accumulation, the DP x CP reduction, clipping and the update; the portable weights (and EMA) in ``dist/``,
  DeepSpeed's own partitions in ``zero/`` (they need the same DP x CP size to load).

    backend.zero_grad()
    total, grad_norm = backend.forward_backward(objective, micro_batches, autocast)
    backend.apply() or backend.discard()            # the step guard decides (train.nonfinite)
    backend.save(staging_dir, ema, asynchronous)    # inside the checkpoint manager's save
    backend.load(checkpoint_dir, state)             # its optimizer state on resume
"""
from __future__ import annotations

import abc
from pathlib import Path

import torch
from megatron.core import parallel_state as ps

from setdiff_mega.checkpoint.io import CheckpointError
from setdiff_mega.checkpoint.sharded import load_sharded, save_sharded
from setdiff_mega.model.tied import allreduce_tied_grads, tied_weights
from setdiff_mega.model.transformer import model_chunks
from setdiff_mega.parallel.ddp import GradReducer
from setdiff_mega.parallel.zero import import_deepspeed, zero_engine  # DeepSpeed itself: only when ZeRO runs

from .optim import build_optimizer
from .step import allreduce_tp_partial_grads, clip_grad_norm, forward_backward, zero_step


class OptimizerBackend(abc.ABC):
    kind: str = ""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def forward_backward(self, objective, micro: list, autocast) -> tuple[float, torch.Tensor]:
        """Gradients of the mean micro-batch loss (reduced and clipped); (this replica's loss, global norm)."""

    def apply(self) -> None:
        """The update of an accepted step."""

    def discard(self) -> None:
        """Drop the gradients of a rejected (non-finite) step."""
        self.optimizer.zero_grad(set_to_none=True)

    @abc.abstractmethod
    def save(self, tmp: Path, ema=None, asynchronous: bool = False):
        """Weights (+ EMA) and the optimizer state into a staging checkpoint; an async request or None."""

    @abc.abstractmethod
    def load(self, ck: Path, state: dict) -> None:
        """The optimizer state of a checkpoint (the weights were loaded before the optimizer existed)."""


class AdamWBackend(OptimizerBackend):
    kind = "adamw"

    def __init__(self, model, optimizer, tc, pc):
        super().__init__(model, optimizer)
        self.tc = tc
        # norm gradients computed on a part of the sequence or of the heads: summed over the TP group
        self.partial_grads = pc.tensor_model_parallel_size > 1 and (pc.sequence_parallel or any(
            getattr(p, "tp_shared", False) for p in model.parameters()))
        self.tied = tied_weights(model_chunks(model))   # PP > 1 with tied embeddings (model/tied.py)
        self.ddp = model
        if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
            # DP x CP ranks: the CP ranks of a replica hold the same weights and add up their gradients
            self.ddp = GradReducer(model, overlap=pc.overlap_grad_reduce, bucket_size=pc.ddp_bucket_size)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.ddp is not self.model:
            self.ddp.zero()                           # megatron-core DDP's gradient buffers

    def forward_backward(self, objective, micro, autocast):
        total = forward_backward(self.model, self.ddp, objective, micro, autocast)
        if self.tied:                                   # a tied embedding's two pipeline stages: one gradient
            allreduce_tied_grads(self.tied)
        if self.partial_grads:
            allreduce_tp_partial_grads(self.model)
        return total, clip_grad_norm(self.model, self.tc.clip_grad)

    def apply(self) -> None:
        self.optimizer.step()

    def save(self, tmp, ema=None, asynchronous=False):
        return save_sharded(tmp / "dist", self.model, self.optimizer, ema, asynchronous=asynchronous)

    def load(self, ck, state) -> None:
        load_sharded(ck / "dist", self.model, self.optimizer)


class ZeroBackend(OptimizerBackend):
    def __init__(self, model, optimizer, tc):
        self.engine = zero_engine(model, optimizer, tc)
        super().__init__(model, self.engine.optimizer)
        self.stage = tc.zero_stage
        self.kind = f"deepspeed_zero{self.stage}"

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, objective, micro, autocast):
        # DeepSpeed: accumulation, the DP x CP reduction, clipping and the update (at the boundary)
        return zero_step(self.engine, objective, micro, autocast)

    def save(self, tmp, ema=None, asynchronous=False):
        if self.stage == 3:         # parameters are partitioned: gather them for the portable copy
            with import_deepspeed().zero.GatheredParameters(list(self.model.parameters())):
                save_sharded(tmp / "dist", self.model, ema=ema)
        else:
            save_sharded(tmp / "dist", self.model, ema=ema)
        self.engine.save_checkpoint(str(tmp / "zero"), tag="state", save_latest=False)
        return None

    def load(self, ck, state) -> None:
        parts = ps.get_data_parallel_world_size(with_context_parallel=True)     # DP x CP
        saved = state.get("zero_partitions", state.get("data_parallel_size"))
        if saved != parts:
            raise CheckpointError(f"'{ck / 'zero'}' holds ZeRO shards for DP x CP = {saved}, this run has "
                                  f"DP x CP = {parts}; use the same world size / TP / CP / PP, or set "
                                  f"train.resume_optimizer=false to resume the weights only")
        path, _ = self.engine.load_checkpoint(str(ck / "zero"), tag="state", load_optimizer_states=True,
                                              load_lr_scheduler_states=False, load_module_strict=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load '{ck / 'zero'}' (missing or truncated shards)")


def optimizer_backend(model, cfg) -> OptimizerBackend:
    """The backend of ``cfg`` (``train.zero_stage``) around ``model``'s AdamW."""
    tc = cfg.train
    optimizer = build_optimizer(model, tc)
    if tc.zero_stage > 0:
        return ZeroBackend(model, optimizer, tc)
    return AdamWBackend(model, optimizer, tc, cfg.parallel)


__all__ = ["OptimizerBackend", "AdamWBackend", "ZeroBackend", "optimizer_backend"]
