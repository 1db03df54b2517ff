"""AR: causal next-token prediction, x[:, :-1] predicts x[:, 1:] (T = L - 1 positions, a causal mask,
every position's logits; the loss is the per-sequence mean NLL of the targets, then the batch mean).
No options of its own; registered as ``objective.name=ar``."""
from __future__ import annotations

import torch

from setdiff_mega import methods

from .base import ModelInputs, Objective, batch_masks


class ARObjective(Objective):
    """Causal next-token prediction: x[:, :-1] predicts x[:, 1:]."""

    name = "ar"

    def build_inputs(self, tokens, context=None, padding=None, generator=None, training=True):
        context, padding, target = batch_masks(tokens, context, padding)
        B, L = tokens.shape
        dev = tokens.device
        mask, pattern = self._mask("causal", L - 1, dev, padding, lambda p: ~p[:, :-1])
        pos = torch.arange(L - 1, device=dev).expand(B, L - 1)
        return ModelInputs(tokens=tokens[:, :-1], position_ids=pos, attention_mask=mask,
                           logits_start=0, targets=tokens[:, 1:], loss_mask=target[:, 1:], attention_pattern=pattern)


AR = methods.register(methods.Method(
    "ar", "AR", ARObjective, "setdiff_mega.decoding.baselines:ARSampler", "exact", causal=True, pattern="causal"))

__all__ = ["ARObjective", "AR"]
