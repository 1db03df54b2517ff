"""BD3LM: block diffusion over the 2L input [x0 ; x_t]. One t per block of S tokens (in training, and always at S =
1, every block with targets gets at least one MASK: the reference's ``_ensure_no_unmasked_blocks``; not in
evaluation, where re-masking would put 1/t weights on a mask rate other than t and inflate the NELBO); positions
[0..L-1] twice; the block-causal two-stream mask (block S); the logits of the noisy half; the loss as MDLM's over
the noisy half. With ``shift_logits`` (Fast-dLLM v2's alignment) the logits cover both halves and target p reads
the noisy row of p - 1 inside its block, the clean row of p - 1 at a block's first position (which sees the
earlier blocks only), its own row at p = 0. Options (:class:`BlockDiffusionOptions`): ``block_size`` (S, which
identifies a run) and MDLM's; it decodes block by block with the finished blocks' K/V cached, by default in
blocks of the training size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from setdiff_mega import methods

from .base import ModelInputs, Objective, batch_masks
from .mdlm import MaskedDiffusionOptions
from .schedules import LinearSchedule


@dataclass
class BlockDiffusionOptions(MaskedDiffusionOptions):
    block_size: int = 4                          # S

    RUN_FIELDS = ("block_size",)

    def check(self, L: int, error) -> None:
        super().check(L, error)
        if self.block_size < 1 or L % self.block_size:
            raise error(f"objective.block_size={self.block_size} must be >= 1 and divide data.seq_length={L}")

    def decoding_defaults(self, L: int) -> dict:
        return {**super().decoding_defaults(L), "block_size": self.block_size}

    def describe(self) -> list[str]:
        return [f"block size {self.block_size}"]

    @property
    def pattern_block(self) -> int:
        return self.block_size


class BD3LMObjective(Objective):
    """Block diffusion over [x0 ; x_t]: one t per block; in training every block with targets gets >= 1 MASK."""

    name = "bd3lm"
    two_stream = True
    normalization = "token"

    def __init__(self, mask_id: int, block_size: int, loss_weighting: str = "unweighted",
                 t_eps: float = 1e-3, eos_id: int | None = None):
        super().__init__(mask_id, loss_weighting, eos_id)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = int(block_size)
        self.schedule = LinearSchedule(eps=t_eps)

    def _noise(self, target, generator, remask: bool = True):
        B, L = target.shape
        S, dev = self.block_size, target.device
        nb = L // S
        t = self.schedule.sample_t((B, nb), generator, dev)
        u = torch.rand(B, L, generator=generator, device=dev)
        masked = (u < t.repeat_interleave(S, dim=1)) & target
        if not remask:
            return masked, t
        # Blocks with targets but no MASK: re-mask a random subset of size n ~ U{1..#targets}.
        tb, mb = target.view(B, nb, S), masked.view(B, nb, S)
        ntgt = tb.sum(-1)
        empty = (ntgt > 0) & ~mb.any(-1)
        n = (torch.rand(B, nb, generator=generator, device=dev) * ntgt).floor().long() + 1
        scores = torch.rand(B, nb, S, generator=generator, device=dev).masked_fill(~tb, 2.0)
        order_rank = scores.argsort(-1).argsort(-1)      # rank of each slot among the block's targets
        pick = tb & (order_rank < n[..., None]) & empty[..., None]
        return (mb | pick).view(B, L), t

    def build_inputs(self, tokens, context=None, padding=None, generator=None, training=True):
        context, padding, target = batch_masks(tokens, context, padding)
        B, L = tokens.shape
        if L % self.block_size:
            raise ValueError(f"sequence length {L} is not a multiple of block_size {self.block_size}")
        dev = tokens.device
        # the reference re-masks all-clean blocks when ``self.training or block_size == 1``
        masked, t = self._noise(target, generator, remask=training or self.block_size == 1)
        xt = torch.where(masked, torch.full_like(tokens, self.mask_id), tokens)
        mask, pattern = self._mask("two_stream", 2 * L, dev, padding, lambda p: (~p).repeat(1, 2),
                                   self.block_size)
        pos = torch.arange(L, device=dev).repeat(2).expand(B, 2 * L)
        weights = None
        if self.loss_weighting == "elbo":
            tb = t.repeat_interleave(self.block_size, dim=1)
            weights = self.schedule.elbo_weight(tb).float()
        start, rows = L, None
        if self.shift_logits:
            start, rows = 0, self.shifted_rows(L, dev).expand(B, L)
        return ModelInputs(tokens=torch.cat([tokens, xt], 1), position_ids=pos, attention_mask=mask,
                           logits_start=start, targets=tokens, loss_mask=masked, weights=weights,
                           extras={"t": t, "num_targets": target.sum(), "target_rows": target},
                           attention_pattern=pattern, logit_rows=rows)

    def shifted_rows(self, L: int, dev) -> torch.Tensor:
        """[L] the row of the 2L output each target position reads under the AR shift."""
        p = torch.arange(L, device=dev)
        return torch.where(p % self.block_size != 0, L + p - 1, torch.where(p > 0, p - 1, L + p))


BD3LM = methods.register(methods.Method(
    "bd3lm", "BD3LM", BD3LMObjective, "setdiff_mega.decoding.baselines:BD3LMSampler", "NELBO",
    options=BlockDiffusionOptions, streams=2, block=True, pattern="two_stream"))

__all__ = ["BD3LMObjective", "BlockDiffusionOptions", "BD3LM"]
