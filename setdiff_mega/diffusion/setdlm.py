"""SetDLM: set diffusion, trained as an any-order autoregressive model over the staggered order prior on
the 2L input [x0[perm] ; MASK...] under the static set-causal mask (in rank space), positions [perm ;
perm], the noisy half's logits, no logit shift; the loss is the per-sequence mean NLL (method.md 3). With
``shift_logits`` (method.md 13) the logits cover both halves and the target of rank r (position p) reads
the clean row of p - 1 when rank(p - 1) < r (that row saw exactly the tokens ranked up to p - 1: with the
identity order, the AR model's state), else its own noisy row L + r.
Options (:class:`SetDLMOptions`): D, S_max (2D unless set), the schedule's k or b, ``keep_clean_bos``,
``eos_last``, the fill-in-the-middle rows (not in the paper; method.md 12) and ``ar_weight`` (not in the paper;
method.md 15): a next-token loss on the clean stream beside the any-order one, the clean row of rank j (position
q) predicting x_{q+1} wherever rank(q + 1) > j (the clean stream is causal in rank order, so that row has not
seen q + 1); the logits then cover both halves. With ``shift_logits`` these pairs are exactly the targets that
read their predecessor's row, so the weight adds ``ar_weight`` times their mean to the loss (the AR head's
share); without it the noisy rows keep predicting their own position and the clean rows learn the next token
as Megatron-Bridge's NemotronLabsDiffusion does on its clean stream. D and S_max identify a run.
It decodes sets inside a sliding window of W = D positions by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from setdiff_mega import methods

from .base import ModelInputs, Objective, batch_masks
from .orders import hitting_times, invert, move_eos_last, order_from_times, permute, sample_exponentials, sample_order
from .schedules import StaggeredSchedule, default_s_max


@dataclass
class SetDLMOptions(methods.Options):
    D: int = 4                                   # desired set size
    S_max: Optional[int] = None                  # the schedule's window; None = 2 * D
    k: Optional[float] = None                    # optional schedule overrides (k or b)
    b: Optional[float] = None
    keep_clean_bos: bool = False                 # pin position 0 (BOS) first
    eos_last: bool = False                       # target EOS last in the order
    fim_rate: float = 0.0                        # not the paper: rows trained with a revealed prefix and the rest
    fim_max_middle: int = 0                      #   of the document (fill-in-the-middle; method.md 12), caps on
    fim_max_suffix: int = 0                      #   the middle's and the suffix's lengths (0 = none)
    ar_weight: float = 0.0                       # not the paper: next-token loss on the clean stream (method.md 15)

    RUN_FIELDS = ("D", "S_max")
    EXCLUSIVE = ("fim_rate", "ar_weight")

    @property
    def every_row_logits(self) -> bool:
        return self.ar_weight > 0

    @property
    def self_speculative(self) -> bool:
        """The next-token loss trains the clean stream's AR head that verifies the window's drafts (method.md 16)."""
        return self.ar_weight > 0

    @property
    def s_max(self) -> int:
        """The window S_max (2D unless set)."""
        return default_s_max(self.D, self.S_max)

    def check(self, L: int, error) -> None:
        s_max = self.s_max
        if self.D < 1:
            raise error(f"objective.D={self.D} must be >= 1")
        if self.D > s_max:
            raise error(f"objective.D={self.D} exceeds objective.S_max={s_max}; set S_max >= D "
                        f"(the default is 2*D: remove the S_max override)")
        if s_max > L:
            raise error(f"objective.S_max={s_max} exceeds data.seq_length L={L}; set S_max <= L "
                        f"(or lower objective.D, since S_max defaults to 2*D)")
        if self.k is not None and self.b is not None:
            raise error("objective.k and objective.b are alternatives: set at most one")
        if self.k is not None and self.k <= 0:
            raise error(f"objective.k={self.k} must be > 0")
        if not self.ar_weight >= 0:
            raise error(f"objective.ar_weight={self.ar_weight} must be >= 0 (0: the paper's loss alone)")
        if not 0.0 <= self.fim_rate <= 1.0 or self.fim_max_middle < 0 or self.fim_max_suffix < 0:
            raise error(f"objective.fim_rate={self.fim_rate} must be in [0, 1] and objective.fim_max_middle="
                        f"{self.fim_max_middle} / fim_max_suffix={self.fim_max_suffix} >= 0 (0 = no cap)")

    def decoding_defaults(self, L: int) -> dict:
        return {**super().decoding_defaults(L), "window": int(self.D)}

    def preset_window(self, per_unit: float) -> int:
        return max(1, int(per_unit * self.D))

    def export_record(self) -> dict:
        return {**super().export_record(), "S_max": self.s_max, "self_speculative": self.self_speculative}

    def describe(self) -> list[str]:
        parts = [f"D = {self.D}, S_max = {self.s_max}"]
        if self.fim_rate:
            parts.append(f"fill-in-the-middle rate {self.fim_rate} (not in the paper's recipe)")
        if self.ar_weight:
            parts.append(f"next-token loss on the clean stream, weight {self.ar_weight} (not in the paper's recipe)")
        return parts


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
    position_extras = ("perm", "rank")

    def __init__(self, mask_id: int, D: int, S_max: int | None = None, k: float | None = None,
                 b: float | None = None, keep_clean_bos: bool = False, eos_last: bool = False,
                 eos_id: int | None = None, fim_rate: float = 0.0, fim_max_middle: int = 0,
                 fim_max_suffix: int = 0, ar_weight: float = 0.0):
        super().__init__(mask_id, "unweighted", eos_id)
        self.D, self.S_max = int(D), default_s_max(D, S_max)
        self.k, self.b = k, b
        self.keep_clean_bos, self.eos_last, self.eos_id = keep_clean_bos, eos_last, eos_id
        if eos_last and eos_id is None:
            raise ValueError("eos_last needs eos_id")
        if not 0.0 <= fim_rate <= 1.0 or fim_max_middle < 0 or fim_max_suffix < 0:
            raise ValueError(f"fim_rate must be in [0, 1] and fim_max_middle / fim_max_suffix >= 0, got "
                             f"{fim_rate}, {fim_max_middle}, {fim_max_suffix}")
        self.fim_rate = float(fim_rate)
        if not ar_weight >= 0:
            raise ValueError(f"ar_weight must be >= 0, got {ar_weight}")
        self.ar_weight = float(ar_weight)
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
        context, padding, target = batch_masks(tokens, context, padding)
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
        context, padding, target = batch_masks(tokens, context, padding)
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
        rank = invert(perm)
        pred_rank, before = self.predecessor_rows(perm, rank)
        own = L + torch.arange(L, device=dev)[None].expand(B, L)      # each target's own noisy row
        rows = torch.where(before, pred_rank, own) if self.shift_logits else own if self.ar_weight else None
        ar_rows, ar_mask = (pred_rank, loss_mask & before) if self.ar_weight else (None, None)
        return ModelInputs(tokens=torch.cat([x0p, xtp], 1), position_ids=perm.repeat(1, 2),
                           attention_mask=mask, logits_start=L if rows is None else 0, targets=x0p,
                           loss_mask=loss_mask, extras={"perm": perm, "rank": rank}, attention_pattern=pattern,
                           logit_rows=rows, ar_rows=ar_rows, ar_mask=ar_mask)

    @staticmethod
    def predecessor_rows(perm: torch.Tensor, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, L] the clean row (rank) of the predecessor p - 1 of the target of each rank (0 where p = 0),
        [B, L] bool: p - 1 exists and comes earlier in the order, so its clean row has not seen p)."""
        L = perm.shape[1]
        pred = perm - 1                                        # the predecessor's position
        pred_rank = rank.gather(1, pred.clamp(min=0))
        r = torch.arange(L, device=perm.device)[None]
        return pred_rank, (pred >= 0) & (pred_rank < r)

    @classmethod
    def shifted_rows(cls, perm: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """[B, L] the row of the 2L (rank-space) output the target of each rank reads under the AR shift."""
        pred_rank, before = cls.predecessor_rows(perm, rank)
        L = perm.shape[1]
        return torch.where(before, pred_rank, L + torch.arange(L, device=perm.device)[None])


SETDLM = methods.register(methods.Method(
    "setdlm", "SetDLM", SetDLMObjective, "setdiff_mega.decoding.setdlm:SetDLMSampler", "any-order bound",
    options=SetDLMOptions, streams=2, window=True, pattern="two_stream"))

__all__ = ["SetDLMObjective", "SetDLMOptions", "SETDLM"]
