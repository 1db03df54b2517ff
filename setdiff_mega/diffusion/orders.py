"""Generation orders: sampling the staggered order, pinning, EOS-last, ranks <-> permutations.

An order of a length-L sequence is a permutation ``perm`` [B, L] (long) with ``perm[b, r]`` = the
original position revealed at rank r. Its inverse ``rank`` [B, L] gives ``rank[b, p]`` = the rank of
original position p. Orders come from first-hitting times T [B, L] (float64): larger T means the
token is revealed earlier, so ``perm = argsort(T, descending, stable)`` (method.md section 2.4).

Pinning: ``permutable`` [B, L] (bool) marks the tokens that may move. The *leading* run of
non-permutable tokens gets T = +inf (they stay first, in original order) and the *trailing* run gets
T = -inf (they stay last). Interior non-permutable tokens get a random T like the others, as in the
reference; the objectives keep context as a prefix and padding as a suffix so nothing is lost.
"""
from __future__ import annotations

import torch

from .schedules import StaggeredSchedule


def leading_run(mask: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: True on the leading run of ``mask`` (positions 0..j where mask holds throughout)."""
    return torch.cumprod(mask.to(torch.int64), dim=-1).bool()


def trailing_run(mask: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: True on the trailing run of ``mask``."""
    return leading_run(mask.flip(-1)).flip(-1)


def sample_exponentials(shape, generator: torch.Generator | None = None,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """E ~ Exp(1) in float64 (i.i.d.)."""
    u = torch.rand(shape, dtype=torch.float64, generator=generator, device=device)
    return -torch.log1p(-u)


def hitting_times(schedule: StaggeredSchedule, exponentials: torch.Tensor,
                  permutable: torch.Tensor | None = None) -> torch.Tensor:
    """First-hitting times [B, n] with the leading/trailing non-permutable runs pinned to +/-inf."""
    times = schedule.first_hitting_times(exponentials)
    if permutable is not None:
        fixed = ~permutable.bool()
        times = torch.where(leading_run(fixed), torch.full_like(times, float("inf")), times)
        times = torch.where(trailing_run(fixed) & ~leading_run(fixed),
                            torch.full_like(times, float("-inf")), times)
    return times


def order_from_times(times: torch.Tensor) -> torch.Tensor:
    """perm [B, L] = argsort(T, descending, stable): earliest revealed (largest T) first."""
    return torch.sort(times, dim=-1, descending=True, stable=True).indices


def order_from_exponentials(schedule: StaggeredSchedule, exponentials: torch.Tensor,
                            permutable: torch.Tensor | None = None) -> torch.Tensor:
    """The order given explicit Exp(1) draws (deterministic; used by tests and by samplers)."""
    return order_from_times(hitting_times(schedule, exponentials, permutable))


def sample_order(schedule: StaggeredSchedule, permutable: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one staggered order per row of ``permutable`` [B, L]."""
    e = sample_exponentials(permutable.shape, generator=generator, device=permutable.device)
    return order_from_exponentials(schedule, e, permutable)


def move_eos_last(perm: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor,
                  padding: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Move every target EOS to the end of the target part of the order (before padding).

    Stable partition of ``perm`` by key: 0 = everything else, 1 = target EOS, 2 = padding.
    """
    tok_r = tokens.gather(1, perm)
    tgt_r = target.gather(1, perm)
    pad_r = padding.gather(1, perm)
    key = torch.where(pad_r, 2, torch.where(tgt_r & (tok_r == eos_id), 1, 0))
    idx = torch.sort(key, dim=-1, stable=True).indices
    return perm.gather(1, idx)


def invert(perm: torch.Tensor) -> torch.Tensor:
    """rank = perm^-1: rank[b, perm[b, r]] = r."""
    rank = torch.empty_like(perm)
    ar = torch.arange(perm.shape[-1], device=perm.device).expand_as(perm)
    return rank.scatter_(-1, perm, ar)


def permute(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x[b, perm[b, r]] for x of shape [B, L] or [B, L, ...]."""
    if x.dim() == 2:
        return x.gather(1, perm)
    idx = perm.view(*perm.shape, *([1] * (x.dim() - 2))).expand(*perm.shape, *x.shape[2:])
    return x.gather(1, idx)


__all__ = [
    "leading_run", "trailing_run", "sample_exponentials", "hitting_times", "order_from_times",
    "order_from_exponentials", "sample_order", "move_eos_last", "invert", "permute",
]
