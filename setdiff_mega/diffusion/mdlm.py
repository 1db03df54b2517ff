"""MDLM: masked diffusion over one stream. Each target token is MASK with probability t ~ U[eps, 1] (one t
per row); the model sees x_t with bidirectional attention (T = L) and predicts every masked target; the
loss averages the NLL over the batch's masked targets (``loss_weighting=elbo``: 1/t weights over all
target tokens, the NELBO); with ``shift_logits`` target p > 0 reads row p - 1 (Dream's alignment). Options
(:class:`MaskedDiffusionOptions`, shared with BD3LM): ``loss_weighting`` and ``t_eps``; it decodes on a
fixed canvas in semi-autoregressive blocks of 32 (no KV cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from setdiff_mega import methods

from .base import ModelInputs, Objective, batch_masks
from .schedules import LinearSchedule


@dataclass
class MaskedDiffusionOptions(methods.Options):
    loss_weighting: str = "unweighted"          # unweighted | elbo (1/t weights: the NELBO)
    t_eps: float = 1e-3                          # t ~ U[t_eps, 1]

    def check(self, L: int, error) -> None:
        if self.loss_weighting not in ("unweighted", "elbo"):
            raise error(f"objective.loss_weighting={self.loss_weighting!r} is not one of unweighted, elbo")
        if not 0.0 < self.t_eps < 1.0:
            raise error(f"objective.t_eps={self.t_eps} must be in (0, 1)")


class MDLMObjective(Objective):
    """Masked diffusion: each target token is MASK with probability t ~ U[eps, 1] (one t per row)."""

    name = "mdlm"
    normalization = "token"

    def __init__(self, mask_id: int, loss_weighting: str = "unweighted", t_eps: float = 1e-3,
                 eos_id: int | None = None):
        super().__init__(mask_id, loss_weighting, eos_id)
        self.schedule = LinearSchedule(eps=t_eps)

    def build_inputs(self, tokens, context=None, padding=None, generator=None, training=True):
        context, padding, target = batch_masks(tokens, context, padding)
        B, L = tokens.shape
        dev = tokens.device
        t = self.schedule.sample_t((B,), generator, dev)
        masked = (torch.rand(B, L, generator=generator, device=dev) < t[:, None]) & target
        xt = torch.where(masked, torch.full_like(tokens, self.mask_id), tokens)
        mask, pattern = self._mask("full", L, dev, padding, lambda p: ~p)
        weights = None
        if self.loss_weighting == "elbo":
            weights = self.schedule.elbo_weight(t)[:, None].float().expand(B, L)
        rows = (torch.arange(L, device=dev) - 1).clamp(min=0).expand(B, L) if self.shift_logits else None
        return ModelInputs(tokens=xt, position_ids=torch.arange(L, device=dev).expand(B, L),
                           attention_mask=mask, logits_start=0, targets=tokens, loss_mask=masked,
                           weights=weights, extras={"t": t, "num_targets": target.sum(), "target_rows": target},
                           attention_pattern=pattern, logit_rows=rows)


MDLM = methods.register(methods.Method(
    "mdlm", "MDLM", MDLMObjective, "setdiff_mega.decoding.baselines:MDLMSampler", "NELBO",
    options=MaskedDiffusionOptions, block=True, cached=False, pattern="full"))

__all__ = ["MDLMObjective", "MaskedDiffusionOptions", "MDLM"]
