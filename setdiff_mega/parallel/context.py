"""Context parallelism (CP) for every objective's layout: each CP rank holds a slice of every stream.

Layout. A micro-batch's model input has T = S x Ls positions: S = 2 streams of L for the two-stream
objectives (SetDLM, BD3LM: clean then noisy), one stream otherwise (AR: L - 1, MDLM: L). With CP = c each
stream (padded at its end to a multiple of 2c: AR's L - 1) is cut into 2c chunks of n positions and rank
r holds chunks r and 2c - 1 - r of every stream, in position order (Megatron's load balancing for causal
attention: early and late chunks together, so every rank has about the same number of visible keys):

    idx_r = concat over streams s, chunks j in (r, 2c-1-r) of  s * Ls' + j * n + [0, n)      [T_loc = 2 S n]

Attention. Queries stay local; keys and values are all-gathered over the CP group in rank order
(:func:`gather_sequence`: forward all-gather, backward the sum of every rank's gradient, returned to
the rank that owns the rows), so rank r's keys are ordered ``perm = concat_r idx_r``. The mask of a
micro-batch with a :class:`~setdiff_mega.diffusion.masks.MaskPattern` is built directly as rows ``idx_r``
and columns ``perm`` ([1|B, T_loc, T'], 1/c of the full mask; the full T x T mask is never built: the
run's objective builds patterns only, ``build_objective(dense_masks=False)``) and the pattern travels
as a view (``pattern.view(idx_r, perm)``) for the core attentions; a hand-built mask without a pattern
is sliced. Every backend attends over the gathered keys: sdpa with the mask rows, FlexAttention with
the view's block mask (T_loc x T'), the set-causal decomposition with the view's chunks
(:func:`setdiff_mega.model.segments.setcausal_plan`: per local chunk, a full block over the earlier
keys and a causal block over its own, merged by log-sum-exp). RoPE is applied before the gather at
each token's own position, so the gathered keys carry the right rotation. No row attends to the CP
layout's padding positions; their own rows (never read) attend to themselves at least.

Loss. Each rank scores its own logit rows (those of ``idx_r`` at or past ``logits_start``) with the
full sequence's denominators (:attr:`ModelInputs.denominators`: tokens per row of the batch, scored
tokens, target tokens), so the CP ranks' losses sum to the single-process loss and their statistics
(NLL sum, token counts) sum to its statistics. Gradients are summed over CP: the caller backpropagates
``loss x CP`` and averages over the data-parallel-with-CP group (DP x CP ranks).

With sequence parallelism the TP ranks split each CP rank's positions; under ZeRO, DeepSpeed partitions over the
DP x CP ranks (setdiff_mega/parallel/zero.py).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_mega.diffusion.masks import MaskPattern


def cp_size_rank() -> tuple[int, int]:
    """(CP size, this rank's CP rank) from megatron-core's parallel state ((1, 0) outside it)."""
    if not ps.model_parallel_is_initialized():
        return 1, 0
    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()


def shard_indices(T: int, streams: int, cp: int, rank: int) -> tuple[torch.Tensor, int]:
    """(positions of rank ``rank`` [T_loc] long, padded stream length Ls') for T positions in ``streams``
    equal streams (see the module docstring)."""
    if T % streams:
        raise ValueError(f"{T} positions do not split into {streams} equal streams")
    Ls = T // streams
    Lp = -(-Ls // (2 * cp)) * 2 * cp
    n = Lp // (2 * cp)
    parts = [s * Lp + j * n + torch.arange(n) for s in range(streams) for j in (rank, 2 * cp - 1 - rank)]
    return torch.cat(parts), Lp


def _pad_stream_dim(x: torch.Tensor, dim: int, streams: int, Lp: int, value) -> torch.Tensor:
    """Pad each of the ``streams`` equal streams along ``dim`` to length ``Lp`` with ``value``."""
    chunks = x.chunk(streams, dim=dim)
    pad = Lp - chunks[0].shape[dim]
    if pad == 0:
        return x
    shape = list(chunks[0].shape)
    shape[dim] = pad
    filler = torch.full(shape, value, dtype=x.dtype, device=x.device)
    return torch.cat([t for c in chunks for t in (c, filler)], dim=dim)


def _padded_mask(mask: torch.Tensor, streams: int, Lp: int) -> torch.Tensor:
    """[1|B, T, T] -> [1|B, T', T']: padding rows see only themselves, nobody sees them."""
    m = _pad_stream_dim(_pad_stream_dim(mask, 1, streams, Lp, False), 2, streams, Lp, False)
    if m.shape[1] != mask.shape[1]:
        real = _pad_stream_dim(torch.ones(mask.shape[1], dtype=torch.bool, device=mask.device), 0, streams, Lp,
                               False)
        m = m | torch.diag(~real)[None]
    return m


def padded_pattern(pattern, streams: int, Lp: int):
    """``pattern`` over the CP layout's padded streams (each padded at its end to ``Lp``): the padding
    positions are invalid keys (seen by nobody, each sees itself), so the real positions keep their mask."""
    Ls = pattern.length // streams
    if Lp == Ls:
        return pattern
    valid = pattern.key_valid if pattern.key_valid is not None else torch.ones(1, pattern.length, dtype=torch.bool)
    valid = _pad_stream_dim(valid.bool(), 1, streams, Lp, False)
    return MaskPattern(pattern.kind, streams * Lp, pattern.block_size, valid)


def _local_mask(inp, streams: int, Lp: int, idx: torch.Tensor, perm: torch.Tensor):
    """(this rank's mask rows [1|B, T_loc, T'] in gathered key order, the pattern view or None)."""
    if inp.attention_pattern is not None:        # from the pattern: the full T x T mask is never built
        view = padded_pattern(inp.attention_pattern, streams, Lp).view(idx, perm)
        # pattern-only inputs stay so: the core attention builds the rows if it needs them
        return (None if inp.attention_mask is None else view.dense(idx.device)), view
    mask = _padded_mask(inp.attention_mask.bool(), streams, Lp)
    return mask[:, idx][:, :, perm], None


def shard_inputs(inp, streams: int, cp: int, rank: int):
    """This CP rank's :class:`~setdiff_mega.diffusion.objectives.ModelInputs` of the full micro-batch ``inp``:
    its positions, its mask rows (from the pattern where there is one, which then travels as a view for the
    core attention), its logit rows and the full micro-batch's loss denominators."""
    if inp.logit_rows is not None or inp.ar_rows is not None:
        raise ValueError("context parallelism cannot gather logit rows read across streams (model.shift_logits, "
                         "a next-token loss on the clean stream): use CP=1")
    B, T = inp.tokens.shape
    idx, Lp = shard_indices(T, streams, cp, rank)
    perm = torch.cat([shard_indices(T, streams, cp, r)[0] for r in range(cp)])
    dev = inp.tokens.device
    idx, perm = idx.to(dev), perm.to(dev)
    mask, view = _local_mask(inp, streams, Lp, idx, perm)
    start = inp.logits_start
    if start % (T // streams):
        raise ValueError(f"logits_start={start} is not a stream boundary of {T} positions in {streams} streams")
    start_p = start // (T // streams) * Lp                       # the same boundary in the padded layout
    rows = idx[idx >= start_p] - start_p                         # this rank's logit rows, padded coordinates
    n_streams_out = streams - start // (T // streams)

    def out_rows(x, value):
        return None if x is None else _pad_stream_dim(x, 1, n_streams_out, Lp, value)[:, rows]

    loss_mask = inp.loss_mask.bool()
    den = {"rows": loss_mask.sum(-1).float(), "total": loss_mask.sum().float()}
    extras = dict(inp.extras)
    if "num_targets" in extras:
        den["targets"] = extras["num_targets"].float()
        if "target_rows" in extras:
            extras["target_rows"] = out_rows(extras["target_rows"], False)
            extras["num_targets"] = extras["target_rows"].sum()
    return dataclasses.replace(
        inp, tokens=_pad_stream_dim(inp.tokens, 1, streams, Lp, 0)[:, idx],
        position_ids=_pad_stream_dim(inp.position_ids, 1, streams, Lp, 0)[:, idx], attention_mask=mask,
        logits_start=int((idx < start_p).sum()), targets=out_rows(inp.targets, 0), loss_mask=out_rows(loss_mask, False),
        weights=out_rows(inp.weights, 0.0), extras=extras, attention_pattern=view, denominators=den)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: the gradient summed over the group, this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)         # gloo has no reduce-scatter; NCCL could use one
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.n:(r + 1) * ctx.n], None


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """[s_loc, ...] on every CP rank -> [CP x s_loc, ...] in rank order, autograd-correct."""
    return _GatherSequence.apply(x, group if group is not None else ps.get_context_parallel_group())


def shard_for_rank(inp, streams: int):
    """``inp`` itself without CP, else this rank's shard (:func:`shard_inputs`)."""
    cp, rank = cp_size_rank()
    return inp if cp == 1 else shard_inputs(inp, streams, cp, rank)


__all__ = ["cp_size_rank", "shard_indices", "shard_inputs", "gather_sequence", "shard_for_rank"]
