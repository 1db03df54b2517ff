"""The objective interface every method implements, its model inputs and the loss (the one way from a
:class:`~setdiff_mega.data.batch.Batch` to model inputs is :func:`setdiff_mega.diffusion.inputs.inputs_for`).

Input batch: clean tokens x [B, L] (long), optional ``context`` [B, L] (bool, prompt tokens: never in
the loss) and ``padding`` [B, L] (bool, right padding). ``target = ~context & ~padding``.

Every objective returns :class:`ModelInputs` for a diffusion-agnostic model
``logits = model(tokens [B, T], position_ids [B, T], attention_mask [1|B, T, T] (True = allowed),
logits_start)`` whose logits cover ``tokens[:, logits_start:]`` ([B, N, V], N = T - logits_start),
and :meth:`Objective.loss` turns those logits into a scalar loss plus statistics. The methods themselves
live in their own modules (:mod:`.ar`, :mod:`.mdlm`, :mod:`.bd3lm`, :mod:`.setdlm`), each with its
options and its registry record.

Head alignment (``model.shift_logits``, method.md 13): by default the logit row of a target's own position
predicts it (the reference). With the AR shift an objective sets ``logit_rows`` [B, N] (long): the row of the
model's output (counted from ``logits_start``) that each target reads, its predecessor's where that row is
leak-free; :meth:`ModelInputs.target_logits` gathers them, so the loss, the likelihoods and the benchmarks
read logits one way.

Losses (method.md sections 3 and 6): the MASK class is excluded (logit -inf) and log-softmax runs in
fp32. ``normalization = "sequence"`` averages the per-token NLL over each sequence's targets, then over
the batch (a sequence without targets contributes 0); in packed rows (``groups`` [B, N]: the document of each
target slot, -1 none) each document is a sequence, and the sum of the documents' means is divided by
``documents`` (the documents a micro-batch stands for: the trainer sets the global batch's count / (micro-batches
x DP), so the loss does not depend on how documents fall into packs, micro-batches or ranks; default: the
micro-batch's own count); ``"token"`` averages over all masked target tokens
in the batch, and with per-token ``weights`` (the 1/t ELBO weights) divides by the number of target
tokens instead (the NELBO). Every loss also reports ``nll_sum`` and ``num_tokens`` so evaluation can
compute token-weighted perplexities.

Next-token loss beside the objective's (``ar_weight`` > 0, method.md 15; SetDLM's ``objective.ar_weight``): an
objective may set ``ar_rows`` / ``ar_mask`` [B, N], for each target slot the output row (from ``logits_start``)
of a clean-stream row that predicts that target as the next token without having seen it, and whether there
is one. The training loss is then

    loss = loss_objective + ar_weight * mean_ar,   mean_ar = the same normalisation over the pairs of ar_mask
                                                   of -log p(target | its ar_rows row)

while ``nll_sum`` / ``num_tokens`` (validation, perplexity) stay the objective's own.
"""
from __future__ import annotations

import abc
import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from . import masks as M


@dataclass
class ModelInputs:
    """What the model consumes and what the loss needs. See the module docstring for layouts."""

    tokens: torch.Tensor            # [B, T] long
    position_ids: torch.Tensor      # [B, T] long (RoPE positions; SetDLM: original positions)
    attention_mask: Optional[torch.Tensor]   # [1|B, T, T] bool, True = allowed (None: built from the pattern)
    logits_start: int               # logits are needed for tokens[:, logits_start:]
    targets: torch.Tensor           # [B, N] long, token each logit row must predict
    loss_mask: torch.Tensor         # [B, N] bool, rows that count in the loss
    weights: Optional[torch.Tensor] = None   # [B, N] float, per-token weights (ELBO mode)
    extras: dict = field(default_factory=dict)  # perm, t, ... (for inspection and tests)
    attention_pattern: Optional[M.MaskPattern] = None   # the mask's structure (kernels may skip the mask)
    denominators: Optional[dict] = None   # a shard's full-sequence counts {rows [B], total, targets} (CP)
    logit_rows: Optional[torch.Tensor] = None   # [B, N] long: the output row each target reads (shift_logits)
    groups: Optional[torch.Tensor] = None       # [B, N] long: packed rows, the document of each target slot (-1)
    documents: Optional[float] = None           # "sequence" loss: the documents it divides by (module docstring)
    ar_rows: Optional[torch.Tensor] = None      # [B, N] long: the clean row predicting each target as next token
    ar_mask: Optional[torch.Tensor] = None      # [B, N] bool: targets with such a row (ar_weight > 0)

    def model_kwargs(self) -> dict:
        """Keyword arguments of the model's forward."""
        return {"tokens": self.tokens, "position_ids": self.position_ids, "attention_mask": self.attention_mask,
                "logits_start": self.logits_start, "attention_pattern": self.attention_pattern}

    @property
    def num_processed_tokens(self) -> int:
        return self.tokens.numel()

    def target_logits(self, logits: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The model's output [B, T - logits_start, V] -> the logits of each target [B, N, V] (read at ``rows``
        instead of ``logit_rows`` when given)."""
        rows = self.logit_rows if rows is None else rows
        if rows is None:
            return logits
        return logits.gather(1, rows[..., None].expand(*rows.shape, logits.shape[-1]))


def masked_token_nll(logits: torch.Tensor, targets: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """Per-token NLL [B, N] in fp32 with the MASK class excluded from the softmax."""
    logits = logits.float()
    if mask_id is not None and 0 <= mask_id < logits.shape[-1]:
        idx = torch.tensor([mask_id], device=logits.device)
        logits = logits.index_fill(-1, idx, float("-inf"))
    logp = F.log_softmax(logits, dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def batch_masks(tokens, context, padding):
    B, L = tokens.shape
    dev = tokens.device
    context = torch.zeros(B, L, dtype=torch.bool, device=dev) if context is None else context.bool()
    padding = torch.zeros(B, L, dtype=torch.bool, device=dev) if padding is None else padding.bool()
    return context, padding, ~context & ~padding


class Objective(abc.ABC):
    """Interface: ``build_inputs`` (batch -> ModelInputs) and ``loss`` (logits -> loss, stats)."""

    name: str = ""
    two_stream: bool = False
    shift_logits: bool = False       # the AR shift (model.shift_logits): targets read :meth:`shifted_rows`
    ar_weight: float = 0.0           # the next-token loss's weight (module docstring; inputs carry ar_rows)
    normalization: str = "sequence"  # "sequence": per-sequence mean then batch mean; "token": global
    dense_masks: bool = True         # False: inputs carry the mask's pattern only (attention_mask None)
    position_extras: tuple = ()      # extras [B, N] that hold positions (packing offsets them: .packing)

    def __init__(self, mask_id: int, loss_weighting: str = "unweighted", eos_id: int | None = None):
        self.mask_id = int(mask_id)
        self.eos_id = eos_id
        if loss_weighting not in ("unweighted", "elbo"):
            raise ValueError(f"loss_weighting must be 'unweighted' or 'elbo', got {loss_weighting!r}")
        self.loss_weighting = loss_weighting
        self._static: dict = {}

    def patterns_only(self) -> "Objective":
        """This objective with ``dense_masks`` off (its inputs carry the mask's pattern only), sharing its caches:
        what the documents of a packed row are built with (their masks are never used)."""
        if not self.dense_masks:
            return self
        if self._static.get("patterns_only") is None:
            twin = copy.copy(self)
            twin.dense_masks = False
            self._static["patterns_only"] = twin
        return self._static["patterns_only"]

    def _cached(self, key, fn):
        if key not in self._static:
            self._static[key] = fn()
        return self._static[key]

    def _mask(self, kind: str, T: int, dev, padding, key_valid_of, block_size: int = 1):
        """(dense mask [1|B, T, T], its :class:`~setdiff_mega.diffusion.masks.MaskPattern`): the static ones
        are built once per shape; with padding, ``key_valid_of(padding)`` gives the valid keys [B, T] and the
        mask is per batch (unless every key is valid)."""
        static = self._cached(("pattern", kind, T, block_size, dev), lambda: M.MaskPattern(kind, T, block_size))
        key_valid = key_valid_of(padding) if padding.any() else None
        if key_valid is None or bool(key_valid.all()):
            if not self.dense_masks:
                return None, static
            return self._cached(("mask", kind, T, block_size, dev), lambda: static.dense(dev)), static
        pattern = static.with_padding(key_valid)
        return (pattern.dense(dev) if self.dense_masks else None), pattern

    @abc.abstractmethod
    def build_inputs(self, tokens, context=None, padding=None, generator=None, training=True) -> ModelInputs:
        """Clean tokens [B, L] (+ context / padding masks) -> this objective's model inputs."""

    def loss(self, logits: torch.Tensor, inputs: ModelInputs):
        """Scalar loss and stats {nll_sum, num_tokens} (token-weighted sums for perplexity)."""
        nll = masked_token_nll(inputs.target_logits(logits), inputs.targets, self.mask_id)
        m = inputs.loss_mask.to(nll.dtype)
        w = m if inputs.weights is None else m * inputs.weights.to(nll.dtype)
        per_tok = nll * w
        den = inputs.denominators or {}        # a context-parallel shard divides by the full sequence's counts
        loss = self._normalise(per_tok, m, inputs, den)
        if self.ar_weight and inputs.ar_mask is not None:
            ar_nll = masked_token_nll(inputs.target_logits(logits, inputs.ar_rows), inputs.targets, self.mask_id)
            m_ar = inputs.ar_mask.to(ar_nll.dtype)
            loss = loss + self.ar_weight * self._normalise(ar_nll * m_ar, m_ar, inputs, {})
        count = m.detach().sum()
        if inputs.weights is not None and self.normalization == "token":
            count = inputs.extras["num_targets"].to(count.dtype)   # NELBO is per target token
        stats = {"nll_sum": per_tok.detach().sum(), "num_tokens": count}
        return loss, stats

    def _normalise(self, per_tok: torch.Tensor, m: torch.Tensor, inputs: ModelInputs, den: dict) -> torch.Tensor:
        """The loss of weighted per-token NLLs ``per_tok`` over the slots of ``m`` [B, N] (module docstring)."""
        if self.normalization == "sequence" and inputs.groups is not None:
            return document_means(per_tok, m, inputs.groups).sum() / document_count(inputs)
        if self.normalization == "sequence":
            per_seq = per_tok.sum(-1) / den.get("rows", m.sum(-1)).clamp(min=1.0)
            return per_seq.sum() / inputs.documents if inputs.documents is not None else per_seq.mean()
        if inputs.weights is not None:  # NELBO: weighted masked NLL over all target tokens
            return per_tok.sum() / den.get("targets", inputs.extras["num_targets"]).clamp(min=1)
        return per_tok.sum() / den.get("total", m.sum()).clamp(min=1.0)


def document_means(values: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per document of ``groups`` [B, N] (ids >= 0; -1 is no document): sum of ``values`` / sum of ``weights``
    ([B, N] each) -> [D] in the order of :func:`torch.unique` (a document without weight gives 0)."""
    ids, inv = torch.unique(groups, return_inverse=True)
    keep = ids >= 0
    sums = torch.zeros(ids.numel(), dtype=values.dtype, device=values.device).index_add(0, inv.flatten(),
                                                                                        values.flatten())
    counts = torch.zeros(ids.numel(), dtype=weights.dtype, device=weights.device).index_add(0, inv.flatten(),
                                                                                            weights.flatten())
    return (sums / counts.clamp(min=1.0))[keep]


def document_count(inputs: ModelInputs) -> float:
    """The documents a packed micro-batch's "sequence" loss divides by (module docstring)."""
    if inputs.documents is not None:
        return inputs.documents
    return max(int((torch.unique(inputs.groups) >= 0).sum()), 1)


def collate_inputs(parts: list[ModelInputs]) -> ModelInputs:
    """Concatenate per-sample ModelInputs along the batch (a shared static mask stays shared)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    masks = [p.attention_mask for p in parts]
    if all(m is None for m in masks):         # patterns only (Objective.dense_masks False)
        mask = None
    elif all(m is masks[0] for m in masks) and masks[0].shape[0] == 1:
        mask = masks[0]
    else:
        mask = torch.cat([m.expand(1, *m.shape[1:]) if m.shape[0] == 1 else m for m in masks], 0)
    extras = {}
    for k, v in first.extras.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == 1:
            extras[k] = torch.cat([p.extras[k] for p in parts], 0)
        elif isinstance(v, torch.Tensor) and v.dim() == 0:
            extras[k] = sum(p.extras[k] for p in parts)
    return ModelInputs(tokens=torch.cat([p.tokens for p in parts]),
                       position_ids=torch.cat([p.position_ids for p in parts]),
                       attention_mask=mask, logits_start=first.logits_start,
                       targets=torch.cat([p.targets for p in parts]), loss_mask=torch.cat([p.loss_mask for p in parts]),
                       weights=None if first.weights is None else torch.cat([p.weights for p in parts]),
                       logit_rows=None if first.logit_rows is None else torch.cat([p.logit_rows for p in parts]),
                       ar_rows=None if first.ar_rows is None else torch.cat([p.ar_rows for p in parts]),
                       ar_mask=None if first.ar_mask is None else torch.cat([p.ar_mask for p in parts]),
                       groups=None if first.groups is None else torch.cat([p.groups for p in parts]),
                       extras=extras, attention_pattern=M.merge_patterns([p.attention_pattern for p in parts],
                                                                         [p.tokens.shape[0] for p in parts]))


__all__ = ["ModelInputs", "Objective", "masked_token_nll", "collate_inputs", "batch_masks", "document_means",
           "document_count"]
