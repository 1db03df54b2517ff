"""Forward / backward / gradient bookkeeping for any (TP, CP, PP, DP) layout.

* PP = 1: micro-batches run through the (optionally DDP-wrapped) model, loss / n_micro each.
* PP > 1: megatron-core's pipeline schedule (1F1B, or interleaved 1F1B over the V model chunks of
  each rank when virtual stages are set) runs the micro-batches; losses live on the last stage and are
  broadcast over the pipeline group so every rank logs and checks the same number.
* Gradients: megatron-core's DDP (:class:`~setdiff_mega.parallel.ddp.GradReducer`) averages them over
  the DP x CP group for every layout, bucketed and overlapped with the last micro-batch's backward (PP = 1:
  :meth:`~setdiff_mega.parallel.ddp.GradReducer.no_sync` for the others; PP > 1: the schedule's
  ``no_sync_func``); :meth:`~setdiff_mega.parallel.ddp.GradReducer.finish` then exposes them as ``.grad``.
* CP > 1 (:mod:`setdiff_mega.parallel.context`): every micro-batch is this rank's shard (:func:`cp_shard`);
  its loss and statistics are this rank's part (they sum over the CP group), the backward uses loss x CP
  (megatron-core's schedule does the same), and logged losses / validation sums add the CP parts.
* Clipping (:func:`clip_grad_norm`): the global L2 norm sums squared gradients over every TP / PP shard,
  counting TP-replicated parameters (norms, row-parallel biases) and a tied embedding's pipeline copy once,
  so it equals the single-process norm.
* Also the step-level helpers the trainer composes: :func:`evaluate` (layout-independent validation),
  :func:`zero_step` (one DeepSpeed step), :func:`mean_over_dp`, :func:`step_epoch`, :func:`autocast_context`.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from setdiff_mega import methods
from setdiff_mega.compat import mcore_cpu
from setdiff_mega.data.loader import batches
from setdiff_mega.diffusion import inputs_for
from setdiff_mega.model.transformer import model_chunks
from setdiff_mega.parallel.context import cp_size_rank, shard_for_rank

from .guard import TrainingError


def cp_shard(objective, inp):
    """This context-parallel rank's shard of a micro-batch's inputs (``inp`` itself without CP)."""
    return shard_for_rank(inp, methods.get(objective.name).streams)


def _cp_group():
    """(CP size, CP group or None)."""
    cp = cp_size_rank()[0]
    return cp, (ps.get_context_parallel_group() if cp > 1 else None)


def _sum_over_cp(value: float) -> float:
    """A context-parallel shard's partial loss -> the micro-batch's loss (the shards' losses add up)."""
    cp, group = _cp_group()
    if cp == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item()


def micro_batch_loss(model, objective, inp, autocast=contextlib.nullcontext):
    """The one micro-batch computation every path shares (training, validation, ZeRO, and the pipeline
    schedule's last stage through :func:`_schedule_run`): logits = model(inputs), then the objective's
    loss; returns (loss, stats). Under context parallelism the inputs are this rank's shard and the loss
    and statistics its part of the micro-batch's (they sum over the CP group)."""
    inp = cp_shard(objective, inp)
    with autocast():
        return objective.loss(model(**inp.model_kwargs()), inp)


def _schedule_run(model, objective, micro, forward_only: bool, autocast, chunks=None):
    cp, cp_group = _cp_group()
    micro = [cp_shard(objective, inp) for inp in micro]

    def forward_step(data_iterator, model):
        inp = next(data_iterator)
        out = model(**inp.model_kwargs())

        def loss_func(output):
            loss, st = objective.loss(output, inp)
            # clone: the schedule scales the returned loss in place (by CP / micro-batches: the gradients are
            # averaged over DP x CP ranks, the CP shards' losses add up)
            return loss, {"loss": loss.detach().clone(), "nll_sum": st["nll_sum"], "num_tokens": st["num_tokens"]}
        return out, loss_func

    T, B = micro[0].tokens.shape[1] * cp, micro[0].tokens.shape[0]      # the schedule divides T by CP itself
    chunks = model_chunks(model) if chunks is None else chunks          # training: the DDP-wrapped chunks
    # interleaved: every chunk consumes the micro-batches in order from its own iterator
    data = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    with mcore_cpu.cuda_redirect(), autocast():
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=chunks,
                                          num_microbatches=len(micro), seq_length=T, micro_batch_size=B,
                                          decoder_seq_length=T, forward_only=forward_only)
    stats = torch.zeros(3, dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        stats[0] = sum(float(x["loss"]) for x in out) / len(out)
        stats[1] = sum(float(x["nll_sum"]) for x in out)
        stats[2] = sum(float(x["num_tokens"]) for x in out)
    dist.all_reduce(stats, group=ps.get_pipeline_model_parallel_group())   # only the last stage is non-zero
    if cp > 1:
        dist.all_reduce(stats, group=cp_group)                              # the CP shards' parts
    return stats


def forward_backward(model, ddp, objective, micro: list, autocast) -> float:
    """Accumulate gradients of the mean micro-batch loss (averaged over DP x CP when ``ddp`` is the
    :class:`~setdiff_mega.parallel.ddp.GradReducer`, local when it is ``model``); returns that mean on every
    rank of the replica."""
    reducer = None if ddp is model else ddp
    if ps.get_pipeline_model_parallel_world_size() > 1:
        total = float(_schedule_run(model, objective, micro, False, autocast,
                                    reducer.chunks if reducer is not None else None)[0])
    else:
        loss_sum, cp = 0.0, _cp_group()[0]
        for i, inp in enumerate(micro):
            sync = reducer is None or i == len(micro) - 1
            with contextlib.nullcontext() if sync else reducer.no_sync():
                loss, _ = micro_batch_loss(ddp, objective, inp, autocast)
                (loss * cp / len(micro)).backward()          # averaged over DP x CP, the CP parts add up
            loss_sum += loss.item() / len(micro)
        total = _sum_over_cp(loss_sum)
    if reducer is not None:
        reducer.finish()
    return total


@torch.no_grad()
def evaluate_batch(model, objective, micro: list, autocast) -> tuple[float, float]:
    """(nll_sum, num_tokens) over the micro-batches ``micro`` on every rank, for any pipeline layout."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        s = _schedule_run(model, objective, micro, True, autocast)
        return float(s[1]), float(s[2])
    nll = n = 0.0
    for inp in micro:
        _, st = micro_batch_loss(model, objective, inp, autocast)
        nll, n = nll + float(st["nll_sum"]), n + float(st["num_tokens"])
    return _sum_over_cp(nll), _sum_over_cp(n)


def _allreduce_grads(grads: list, group, size: int, average: bool) -> None:
    """One flat all-reduce of ``grads`` over ``group`` (of ``size`` ranks), written back in place."""
    if size == 1 or not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    if average:
        flat /= size
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def counted_once(p) -> bool:
    """Whether a parameter counts in global sums (norms, sizes): not a TP replica, not a pipeline stage's copy
    of a tied embedding (:mod:`setdiff_mega.model.tied`)."""
    return param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)


def tp_partial_grads(model) -> list:
    """Gradients that each TP rank holds only a part of: norm weights under sequence parallelism (their rank's
    sequence shard; megatron-core marks them ``param.sequence_parallel``) and q / k norms (their rank's heads;
    ``param.tp_shared``, :class:`setdiff_mega.model.spec.Norm`)."""
    return [p.grad for p in model.parameters() if p.grad is not None
            and (getattr(p, "sequence_parallel", False) or getattr(p, "tp_shared", False))]


def allreduce_tp_partial_grads(model) -> None:
    """Sum the :func:`tp_partial_grads` over the TP group."""
    if ps.get_tensor_model_parallel_world_size() > 1:
        _allreduce_grads(tp_partial_grads(model), ps.get_tensor_model_parallel_group(),
                         ps.get_tensor_model_parallel_world_size(), average=False)


def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm``; returns the global norm (pre-clip)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    counted = [p.grad for p in model.parameters() if p.grad is not None and counted_once(p)]
    sq = torch.zeros(1, dtype=torch.float32)
    for g in counted:
        sq += g.detach().float().pow(2).sum().cpu()
    if dist.is_initialized() and ps.get_model_parallel_group() is not None and \
            dist.get_world_size(ps.get_model_parallel_group()) > 1:
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = sq.sqrt()[0]
    if max_norm > 0 and torch.isfinite(norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
    return norm


def autocast_context(precision: str):
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)


@torch.no_grad()
def evaluate(model, objective, dataset, cfg, iters: int, seed: int = 0, bos_eos=None) -> dict:
    """Validation on the first ``iters * micro_batch_size * DP`` samples, split over the data-parallel
    ranks, with per-sample noise: the result does not depend on the parallel layout.

    ``loss`` is the token-weighted NLL (sum of per-token NLL / number of scored tokens; for packed data
    without padding it equals the training loss's per-sequence mean), ``ppl`` its exponential.
    """
    was_training = model.training
    model.eval()
    mbs = cfg.train.micro_batch_size
    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    dp_rank = ps.get_data_parallel_rank() if ps.model_parallel_is_initialized() else 0
    sums = torch.zeros(2, dtype=torch.float64)
    it = batches(dataset, mbs, dp_rank * mbs, dp * mbs, bos_eos=bos_eos)
    # interleaved pipeline stages need >= PP micro-batches per schedule run: split each batch into PP parts
    parts = ps.get_pipeline_model_parallel_world_size() \
        if ps.model_parallel_is_initialized() and ps.get_virtual_pipeline_model_parallel_world_size() else 1
    for _ in range(iters):
        batch = next(it)
        step = batch.rows // parts
        micro = [inputs_for(objective, batch.row_slice(j, j + step), seed, training=False)
                 for j in range(0, batch.rows, step)]
        s, n = evaluate_batch(model, objective, micro, lambda: autocast_context(cfg.train.precision))
        sums += torch.tensor([s, n], dtype=torch.float64)
    if dp > 1:
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
    model.train(was_training)
    mean_nll = float(sums[0] / sums[1].clamp(min=1.0))
    return {"loss": mean_nll, "nll_per_token": mean_nll, "ppl": math.exp(min(mean_nll, 50))}


def mean_over_dp(value: float, dp: int) -> float:
    """Mean of a per-replica value over the data-parallel group (all TP / PP ranks of a replica hold the
    same value, so a NaN on any rank still reaches every rank)."""
    if dp == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t.item() / dp


def zero_step(engine, objective, micro, autocast):
    """One optimizer step through a DeepSpeed engine; a non-finite loss on any rank stops before the update."""
    total, cp = 0.0, _cp_group()[0]
    for inp in micro:
        loss, _ = micro_batch_loss(engine, objective, inp, autocast)
        bad = torch.tensor([0.0 if math.isfinite(loss.item()) else 1.0])
        dist.all_reduce(bad)
        if bad.item():
            raise TrainingError(f"non-finite loss on {int(bad.item())} rank(s); no update was applied. Lower "
                                f"train.lr or use train.precision=fp32")
        # scaled by 1 / gradient_accumulation_steps and averaged over DP x CP inside DeepSpeed: x CP makes
        # the CP shards' parts add up (as in forward_backward)
        engine.backward(loss * cp)
        engine.step()                  # the optimizer steps at the accumulation boundary
        total += loss.item() / len(micro)
    norm = engine.get_global_grad_norm()
    return _sum_over_cp(total), torch.tensor(float(norm) if norm is not None else 0.0)


def step_epoch(sample_index: int, n: int) -> int:
    """Epoch of a sample position in the (wrapping) sample stream, so repeated samples get fresh noise."""
    return (sample_index // max(n, 1)) * 7919


def total_parameters(model) -> int:
    """Parameters of the whole model (all TP shards and PP stages, replicated ones counted once; under
    ZeRO-3 a partitioned parameter's full size is its ``ds_numel``)."""
    n = torch.tensor([sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if counted_once(p))])
    group = ps.get_model_parallel_group()
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(n, group=group)
    return int(n)


__all__ = ["forward_backward", "evaluate_batch", "allreduce_tp_partial_grads",
           "clip_grad_norm", "autocast_context", "evaluate", "mean_over_dp", "zero_step",
           "step_epoch", "total_parameters"]
