"""AdamW with decoupled weight decay and the learning-rate schedules.

Parameter groups: matrices decay, biases and norm weights (1-D parameters) do not.
Schedules, as a multiplier of ``lr`` at optimizer step s (0-based) of S total, W warmup steps:

    warmup:    lr * (s + 1) / W                     for s < W
    constant:  lr
    cosine:    min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,   p = (s - W) / (S - W)
    linear:    lr - (lr - min_lr) * p
    wsd:       lr until the last ``decay_fraction`` of steps, then linear to min_lr
"""
from __future__ import annotations

import math

import torch


def param_groups(model: torch.nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, tc) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=tc.lr,
                             betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps)


def lr_at(step: int, tc) -> float:
    """Learning rate at optimizer step ``step`` for a TrainConfig ``tc``."""
    W, S = tc.warmup_steps, tc.train_steps
    if W > 0 and step < W:
        return tc.lr * (step + 1) / W
    if tc.lr_schedule == "constant":
        return tc.lr
    span = max(S - W, 1)
    p = min(max((step - W) / span, 0.0), 1.0)
    if tc.lr_schedule == "cosine":
        return tc.min_lr + (tc.lr - tc.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    if tc.lr_schedule == "linear":
        return tc.lr - (tc.lr - tc.min_lr) * p
    if tc.lr_schedule == "wsd":
        decay_start = S - int(round(tc.decay_fraction * S))
        if step < decay_start:
            return tc.lr
        q = (step - decay_start) / max(S - decay_start, 1)
        return tc.lr - (tc.lr - tc.min_lr) * min(q, 1.0)
    raise ValueError(f"unknown lr schedule {tc.lr_schedule!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


__all__ = ["build_optimizer", "param_groups", "lr_at", "set_lr"]
