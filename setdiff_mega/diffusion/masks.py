"""Attention patterns for the four objectives. Convention: a bool mask with True = ALLOWED.

(The model converts to megatron-core's convention, True = masked out, at its boundary.)

Shapes: static masks are [T, T]; per-sample masks are [B, T, T]. Queries are rows, keys columns.

Set-causal mask over the 2L input (method.md section 4.1), in permuted (rank) space, with
i = q mod L and j = k mod L (q, k < L is the clean stream, >= L the noisy stream):

    clean q -> clean k : j <= i        noisy q -> clean k : j <  i
    noisy q -> noisy k : j == i        clean q -> noisy k : never

Rank form in original-position space (no token permutation), rank = perm^-1:
    allowed(q, k) = clean_q & clean_k & rank_k <= rank_q
                  | noisy_q & clean_k & rank_k <  rank_q
                  | noisy_q & noisy_k & pos_k == pos_q
BD3LM block mask with block size S over [x0 ; x_t] (block(p) = p // S):
    clean -> clean: block_k <= block_q;  noisy -> clean: block_k < block_q;
    noisy -> noisy: block_k == block_q;  clean -> noisy: never.
With S = 1 it equals the set-causal mask.
"""
from __future__ import annotations

import torch


def causal_mask(T: int, device=None) -> torch.Tensor:
    """[T, T]: k <= q."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def bidirectional_mask(T: int, device=None) -> torch.Tensor:
    """[T, T]: all pairs allowed (padding is added with :func:`with_key_padding`)."""
    return torch.ones(T, T, dtype=torch.bool, device=device)


def _two_stream(cc: torch.Tensor, nc: torch.Tensor, nn: torch.Tensor) -> torch.Tensor:
    """Assemble [..., 2L, 2L] from the clean->clean, noisy->clean and noisy->noisy [..., L, L] blocks."""
    none = torch.zeros_like(cc)
    top = torch.cat([cc, none], dim=-1)
    bottom = torch.cat([nc, nn], dim=-1)
    return torch.cat([top, bottom], dim=-2)


def block_diffusion_mask(L: int, block_size: int, device=None) -> torch.Tensor:
    """[2L, 2L] BD3LM mask over [x0 ; x_t] with blocks of ``block_size`` positions."""
    blk = torch.arange(L, device=device) // block_size
    bq, bk = blk[:, None], blk[None, :]
    return _two_stream(bk <= bq, bk < bq, bk == bq)


def setcausal_mask(L: int, device=None) -> torch.Tensor:
    """[2L, 2L] static set-causal mask in permuted (rank) space."""
    r = torch.arange(L, device=device)
    rq, rk = r[:, None], r[None, :]
    return _two_stream(rk <= rq, rk < rq, rk == rq)


def setcausal_mask_from_ranks(rank: torch.Tensor) -> torch.Tensor:
    """[B, 2L, 2L] set-causal mask in original-position space from ``rank`` [B, L]."""
    rq, rk = rank[:, :, None], rank[:, None, :]
    L = rank.shape[-1]
    eye = torch.eye(L, dtype=torch.bool, device=rank.device).expand(rank.shape[0], L, L)
    return _two_stream(rk <= rq, rk < rq, eye)


def with_key_padding(mask: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """AND a key-validity mask ``valid`` [B, T] into ``mask`` [T, T] or [B, T, T] -> [B, T, T].

    Invalid (padding) keys are hidden from every query; a padding query additionally keeps itself so
    no row is empty (a fully masked softmax row would be NaN). Padding rows never enter a loss. Returns ``mask`` unchanged if ``valid`` is None.
    """
    if valid is None:
        return mask
    T = valid.shape[-1]
    eye = torch.eye(T, dtype=torch.bool, device=valid.device)
    return (mask & valid[:, None, :]) | (eye & ~valid[:, :, None])


__all__ = ["causal_mask", "bidirectional_mask", "block_diffusion_mask", "setcausal_mask",
           "setcausal_mask_from_ranks", "with_key_padding"]
