"""AR, MDLM, BD3LM and SetDLM as one family: each builds model inputs from clean tokens and a loss.

Input batch: clean tokens x [B, L] (long), optional ``context`` [B, L] (bool, prompt tokens: never in
the loss) and ``padding`` [B, L] (bool, right padding). ``target = ~context & ~padding``.

Every objective returns :class:`ModelInputs` for a diffusion-agnostic model
``logits = model(tokens [B, T], position_ids [B, T], attention_mask [1|B, T, T] (True = allowed),
logits_start)`` whose logits cover ``tokens[:, logits_start:]`` ([B, N, V], N = T - logits_start),
and :meth:`Objective.loss` turns those logits into a scalar loss plus statistics.

    objective | T   | tokens               | positions       | mask                 | logits on
    AR        | L-1 | x[:, :-1]            | 0..L-2          | causal               | all; predict x[:, 1:]
    MDLM      | L   | x_t (MASK w.p. t)    | 0..L-1          | bidirectional        | all; masked targets
    BD3LM     | 2L  | [x0 ; x_t] (t/block) | [0..L-1]*2      | block mask, size S   | noisy half
    SetDLM    | 2L  | [x0[perm] ; MASK..]  | [perm ; perm]   | static set-causal    | noisy half; no shift

Losses (method.md sections 3 and 6): the MASK class is excluded (logit -inf) and log-softmax runs in
fp32. AR and SetDLM average the per-token NLL over each sequence's targets, then over the batch (a
sequence without targets contributes 0). MDLM / BD3LM average the NLL over all masked target tokens
in the batch; ``loss_weighting="elbo"`` weights each by 1/t and divides by the number of target
tokens instead (the NELBO). Every loss also reports ``nll_sum`` and ``num_tokens`` so evaluation can
compute token-weighted perplexities.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from setdiff_mega import methods
from setdiff_mega.methods import default_s_max

from . import masks as M
from .orders import hitting_times, invert, move_eos_last, order_from_times, permute, sample_exponentials, sample_order
from .schedules import LinearSchedule, StaggeredSchedule

OBJECTIVES = methods.names()


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

    def model_kwargs(self) -> dict:
        """Keyword arguments of the model's forward."""
        return {"tokens": self.tokens, "position_ids": self.position_ids, "attention_mask": self.attention_mask,
                "logits_start": self.logits_start, "attention_pattern": self.attention_pattern}

    @property
    def num_processed_tokens(self) -> int:
        return self.tokens.numel()


def masked_token_nll(logits: torch.Tensor, targets: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """Per-token NLL [B, N] in fp32 with the MASK class excluded from the softmax."""
    logits = logits.float()
    if mask_id is not None and 0 <= mask_id < logits.shape[-1]:
        idx = torch.tensor([mask_id], device=logits.device)
        logits = logits.index_fill(-1, idx, float("-inf"))
    logp = F.log_softmax(logits, dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _batch_masks(tokens, context, padding):
    B, L = tokens.shape
    dev = tokens.device
    context = torch.zeros(B, L, dtype=torch.bool, device=dev) if context is None else context.bool()
    padding = torch.zeros(B, L, dtype=torch.bool, device=dev) if padding is None else padding.bool()
    return context, padding, ~context & ~padding


class Objective(abc.ABC):
    """Interface: ``build_inputs`` (batch -> ModelInputs) and ``loss`` (logits -> loss, stats)."""

    name: str = ""
    two_stream: bool = False
    normalization: str = "sequence"  # "sequence": per-sequence mean then batch mean; "token": global
    dense_masks: bool = True         # False: inputs carry the mask's pattern only (attention_mask None)

    def __init__(self, mask_id: int, loss_weighting: str = "unweighted"):
        self.mask_id = int(mask_id)
        if loss_weighting not in ("unweighted", "elbo"):
            raise ValueError(f"loss_weighting must be 'unweighted' or 'elbo', got {loss_weighting!r}")
        self.loss_weighting = loss_weighting
        self._static: dict = {}

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
        nll = masked_token_nll(logits, inputs.targets, self.mask_id)
        m = inputs.loss_mask.to(nll.dtype)
        w = m if inputs.weights is None else m * inputs.weights.to(nll.dtype)
        per_tok = nll * w
        den = inputs.denominators or {}        # a context-parallel shard divides by the full sequence's counts
        if self.normalization == "sequence":
            per_seq = per_tok.sum(-1) / den.get("rows", m.sum(-1)).clamp(min=1.0)
            loss = per_seq.mean()
        elif inputs.weights is not None:  # NELBO: weighted masked NLL over all target tokens
            loss = per_tok.sum() / den.get("targets", inputs.extras["num_targets"]).clamp(min=1)
        else:
            loss = per_tok.sum() / den.get("total", m.sum()).clamp(min=1.0)
        count = m.detach().sum()
        if inputs.weights is not None and self.normalization == "token":
            count = inputs.extras["num_targets"].to(count.dtype)   # NELBO is per target token
        stats = {"nll_sum": per_tok.detach().sum(), "num_tokens": count}
        return loss, stats


class ARObjective(Objective):
    """Causal next-token prediction: x[:, :-1] predicts x[:, 1:]."""

    name = "ar"

    def build_inputs(self, tokens, context=None, padding=None, generator=None, training=True):
        context, padding, target = _batch_masks(tokens, context, padding)
        B, L = tokens.shape
        dev = tokens.device
        mask, pattern = self._mask("causal", L - 1, dev, padding, lambda p: ~p[:, :-1])
        pos = torch.arange(L - 1, device=dev).expand(B, L - 1)
        return ModelInputs(tokens=tokens[:, :-1], position_ids=pos, attention_mask=mask,
                           logits_start=0, targets=tokens[:, 1:], loss_mask=target[:, 1:], attention_pattern=pattern)


class MDLMObjective(Objective):
    """Masked diffusion: each target token is MASK with probability t ~ U[eps, 1] (one t per row)."""

    name = "mdlm"
    normalization = "token"

    def __init__(self, mask_id: int, loss_weighting: str = "unweighted", t_eps: float = 1e-3):
        super().__init__(mask_id, loss_weighting)
        self.schedule = LinearSchedule(eps=t_eps)

    def build_inputs(self, tokens, context=None, padding=None, generator=None, training=True):
        context, padding, target = _batch_masks(tokens, context, padding)
        B, L = tokens.shape
        dev = tokens.device
        t = self.schedule.sample_t((B,), generator, dev)
        masked = (torch.rand(B, L, generator=generator, device=dev) < t[:, None]) & target
        xt = torch.where(masked, torch.full_like(tokens, self.mask_id), tokens)
        mask, pattern = self._mask("full", L, dev, padding, lambda p: ~p)
        weights = None
        if self.loss_weighting == "elbo":
            weights = self.schedule.elbo_weight(t)[:, None].float().expand(B, L)
        return ModelInputs(tokens=xt, position_ids=torch.arange(L, device=dev).expand(B, L),
                           attention_mask=mask, logits_start=0, targets=tokens, loss_mask=masked,
                           weights=weights, extras={"t": t, "num_targets": target.sum(), "target_rows": target},
                           attention_pattern=pattern)


class BD3LMObjective(Objective):
    """Block diffusion over [x0 ; x_t]: one t per block, every block with targets gets >= 1 MASK."""

    name = "bd3lm"
    two_stream = True
    normalization = "token"

    def __init__(self, mask_id: int, block_size: int, loss_weighting: str = "unweighted",
                 t_eps: float = 1e-3):
        super().__init__(mask_id, loss_weighting)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = int(block_size)
        self.schedule = LinearSchedule(eps=t_eps)

    def _noise(self, target, generator):
        B, L = target.shape
        S, dev = self.block_size, target.device
        nb = L // S
        t = self.schedule.sample_t((B, nb), generator, dev)
        u = torch.rand(B, L, generator=generator, device=dev)
        masked = (u < t.repeat_interleave(S, dim=1)) & target
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
        context, padding, target = _batch_masks(tokens, context, padding)
        B, L = tokens.shape
        if L % self.block_size:
            raise ValueError(f"sequence length {L} is not a multiple of block_size {self.block_size}")
        dev = tokens.device
        masked, t = self._noise(target, generator)
        xt = torch.where(masked, torch.full_like(tokens, self.mask_id), tokens)
        mask, pattern = self._mask("two_stream", 2 * L, dev, padding, lambda p: (~p).repeat(1, 2),
                                   self.block_size)
        pos = torch.arange(L, device=dev).repeat(2).expand(B, 2 * L)
        weights = None
        if self.loss_weighting == "elbo":
            tb = t.repeat_interleave(self.block_size, dim=1)
            weights = self.schedule.elbo_weight(tb).float()
        return ModelInputs(tokens=torch.cat([tokens, xt], 1), position_ids=pos, attention_mask=mask,
                           logits_start=L, targets=tokens, loss_mask=masked, weights=weights,
                           extras={"t": t, "num_targets": target.sum(), "target_rows": target},
                           attention_pattern=pattern)


class SetDLMObjective(Objective):
    """Set diffusion: AO-AR training on a staggered order, the 2L set-causal layout, no logit shift.

    ``keep_clean_bos`` pins position 0 first (it is in the training loss and dropped from the eval
    loss); ``eos_last`` moves target EOS tokens to the end of the target order.

    ``fim_rate`` (not in the paper; method.md 12): in training, that fraction of the rows is reordered
    for document-level fill-in-the-middle (the two-cut FIM of code models, per document). Per row draw a
    position p ~ U{1..L-1}; its document is [s, t] (s after the last EOS before p, t = the first EOS at
    or after p, or L - 1). Two cut points c, c' ~ U{s..t} give the middle [a, b) = [min, max + 1) and
    the suffix span [b, t + 1) (the rest of the document with its EOS; empty when the middle reaches it).
    ``fim_max_middle`` / ``fim_max_suffix`` (0 = none) cap the two lengths for long documents. The prefix
    [0, a) and the span are revealed first, in position order (first-hitting time +inf: exactly the
    causal position-order prefill of an infilling prompt), then every other token in the staggered order.
    The order stays a permutation, so the loss is still an any-order NLL (every token is scored); only
    the rows it draws change.
    """

    name = "setdlm"
    two_stream = True

    def __init__(self, mask_id: int, D: int, S_max: int | None = None, k: float | None = None,
                 b: float | None = None, keep_clean_bos: bool = False, eos_last: bool = False,
                 eos_id: int | None = None, fim_rate: float = 0.0, fim_max_middle: int = 0,
                 fim_max_suffix: int = 0):
        super().__init__(mask_id, "unweighted")
        self.D, self.S_max = int(D), default_s_max(D, S_max)
        self.k, self.b = k, b
        self.keep_clean_bos, self.eos_last, self.eos_id = keep_clean_bos, eos_last, eos_id
        if eos_last and eos_id is None:
            raise ValueError("eos_last needs eos_id")
        if not 0.0 <= fim_rate <= 1.0 or fim_max_middle < 0 or fim_max_suffix < 0:
            raise ValueError(f"fim_rate must be in [0, 1] and fim_max_middle / fim_max_suffix >= 0, got "
                             f"{fim_rate}, {fim_max_middle}, {fim_max_suffix}")
        self.fim_rate = float(fim_rate)
        self.fim_max_middle, self.fim_max_suffix = int(fim_max_middle), int(fim_max_suffix)

    def schedule(self, L: int) -> StaggeredSchedule:
        return self._cached(("sched", L), lambda: StaggeredSchedule.create(L, self.D, self.S_max, self.k, self.b))

    def decode_order_times(self, L: int, s_max: int, n: int, generator=None) -> torch.Tensor:
        """First-hitting times [n] (float64) of n generated positions under this prior with ``S_max = s_max``
        (decoding's ``fht_cache_order``, method.md 4.6); ValueError when that prior is invalid."""
        sched = StaggeredSchedule.create(L, self.D, s_max, self.k, self.b)
        return sched.first_hitting_times(sample_exponentials((n,), generator=generator))

    def order(self, tokens, context=None, padding=None, generator=None, training=True) -> torch.Tensor:
        """Sample perm [B, L] for a batch (pinned prefix/suffix, optional BOS pin and EOS-last)."""
        context, padding, target = _batch_masks(tokens, context, padding)
        permutable = ~(context | padding)
        if self.keep_clean_bos:
            permutable = permutable.clone()
            permutable[:, 0] = False
        if self.fim_rate > 0 and training:
            e = sample_exponentials(permutable.shape, generator=generator, device=permutable.device)
            times = hitting_times(self.schedule(tokens.shape[1]), e, permutable)
            pinned = self.fim_pinned(tokens, permutable, generator)
            perm = order_from_times(torch.where(pinned, torch.full_like(times, float("inf")), times))
        else:
            perm = sample_order(self.schedule(tokens.shape[1]), permutable, generator)
        if self.eos_last and training:
            perm = move_eos_last(perm, tokens, target, padding, self.eos_id)
        return perm

    def fim_pinned(self, tokens: torch.Tensor, permutable: torch.Tensor, generator=None) -> torch.Tensor:
        """[B, L] bool: the prefix and suffix span revealed first in the rows drawn for fill-in-the-middle."""
        B, L = tokens.shape
        dev = tokens.device
        u = torch.rand(B, 4, generator=generator, device=dev)
        pos = torch.arange(L, device=dev).expand(B, L)
        eos = tokens == self.eos_id if self.eos_id is not None else torch.zeros_like(permutable)
        last = torch.where(eos, pos, torch.full_like(pos, -1)).cummax(-1).values              # last EOS <= j
        nxt = torch.where(eos, pos, torch.full_like(pos, L - 1)).flip(-1).cummin(-1).values.flip(-1)  # next >= j
        p = (1 + (u[:, 1] * (L - 1)).long()).clamp(max=L - 1)[:, None]
        s = (last.gather(1, p - 1) + 1).clamp(min=1)
        t = nxt.gather(1, p)
        n = t - s + 1
        c = s + (u[:, 2:] * n).long().minimum(n - 1)
        a, b = c.min(1, keepdim=True).values, c.max(1, keepdim=True).values + 1
        if self.fim_max_middle:
            b = b.minimum(a + self.fim_max_middle)
        e = t + 1 if not self.fim_max_suffix else (t + 1).minimum(b + self.fim_max_suffix)
        pinned = (pos < a) | ((pos >= b) & (pos < e))
        return pinned & permutable & (u[:, :1] < self.fim_rate)

    def build_inputs(self, tokens, context=None, padding=None, generator=None, training=True, perm=None):
        context, padding, target = _batch_masks(tokens, context, padding)
        B, L = tokens.shape
        dev = tokens.device
        if perm is None:
            perm = self.order(tokens, context, padding, generator, training)
        x0p = permute(tokens, perm)
        tgt_p = permute(target, perm)
        xtp = torch.where(tgt_p, torch.full_like(x0p, self.mask_id), x0p)
        # pinned context takes the first ranks and padding the last: the pattern stays the static set-causal one
        mask, pattern = self._mask("two_stream", 2 * L, dev, padding,
                                   lambda p: (~permute(p, perm)).repeat(1, 2))
        loss_mask = tgt_p
        if self.keep_clean_bos and not training:   # eval: BOS is not scored (method.md P7)
            loss_mask = loss_mask.clone()
            loss_mask[:, 0] = False
        return ModelInputs(tokens=torch.cat([x0p, xtp], 1), position_ids=perm.repeat(1, 2),
                           attention_mask=mask, logits_start=L, targets=x0p, loss_mask=loss_mask,
                           extras={"perm": perm, "rank": invert(perm)}, attention_pattern=pattern)


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
                       extras=extras, attention_pattern=M.merge_patterns([p.attention_pattern for p in parts],
                                                                         [p.tokens.shape[0] for p in parts]))


def build_inputs_per_sample(objective: Objective, tokens: torch.Tensor, sample_ids, seed: int,
                            training: bool = True) -> ModelInputs:
    """Noise of row i drawn from a generator seeded by (seed, sample_ids[i]): the inputs of a sample do not
    depend on which rank, batch or step reads it (layout-independent training, exact resumes)."""
    parts = []
    for i, sid in enumerate(sample_ids):
        g = torch.Generator(device=tokens.device).manual_seed((int(seed) * 1_000_003 + int(sid)) % (2 ** 63))
        parts.append(objective.build_inputs(tokens[i:i + 1], generator=g, training=training))
    return collate_inputs(parts)


def build_objective(name: str, mask_id: int, *, block_size: int = 4, D: int = 4,
                    S_max: int | None = None, k: float | None = None, b: float | None = None,
                    keep_clean_bos: bool = False, eos_last: bool = False, eos_id: int | None = None,
                    loss_weighting: str = "unweighted", t_eps: float = 1e-3, fim_rate: float = 0.0,
                    fim_max_middle: int = 0, fim_max_suffix: int = 0, dense_masks: bool = True) -> Objective:
    """Factory by name through the method registry (:mod:`setdiff_mega.methods`); the keyword arguments are
    the ObjectiveConfig fields (each method takes the ones it uses). ``dense_masks=False``: the inputs carry
    the mask's pattern only (context parallelism builds each rank's rows from it)."""
    from types import SimpleNamespace

    try:
        method = methods.get(name)
    except methods.MethodError:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(methods.names())}") from None
    fields = SimpleNamespace(block_size=block_size, D=D, S_max=S_max, k=k, b=b, keep_clean_bos=keep_clean_bos,
                             eos_last=eos_last, loss_weighting=loss_weighting, t_eps=t_eps, fim_rate=fim_rate,
                             fim_max_middle=fim_max_middle, fim_max_suffix=fim_max_suffix)
    obj = method.build(fields, mask_id, eos_id)
    obj.dense_masks = bool(dense_masks)
    return obj


__all__ = ["OBJECTIVES", "ModelInputs", "collate_inputs", "build_inputs_per_sample", "Objective", "ARObjective",
           "MDLMObjective", "BD3LMObjective", "SetDLMObjective", "build_objective", "masked_token_nll"]
