"""Token choice, confidence and the commit rule shared by the samplers.

For candidate rows with (processed, :mod:`.processors`) logits [..., V]:

    logits[..., banned] = -inf            (MASK is never produced; EOS may be, even when PAD == EOS)
    p = softmax((logits - max logits) / temperature)   (temperature 0: greedy, p = softmax(logits); a NaN
                                          logit counts as -inf, +inf as the largest float: p stays finite)
    p = top_p_filter(p)                   (nucleus: keep the most probable tokens up to and including
                                           the one whose cumulative mass crosses top_p; renormalise)
    p = min_p_filter(p)                   (keep the tokens with p >= min_p * max p, transformers'
                                           MinPLogitsWarper; renormalise; min_p = 0: off)
    greedy:  x = argmax p      sampled: x ~ p   (each row from its own generator, seeded by its request)
    confidence c = p[x]                   (after the filter, as the reference does for greedy decoding too)

Commit rule over the active set of a row (method.md 5.1, P11; ``commit_rule``):

    "confidence" (the paper):  commit = (the k most confident active positions) U {active p : c_p >= tau}
    "leftmost" (not the paper, method.md 15):
                               commit = (the k leftmost active positions)      U {active p : c_p >= tau}

so tau > 1 commits exactly k tokens per step, and lowering tau never commits fewer tokens on the same
logits. Under "leftmost" the forced commit is the position a left-to-right model would write next; every
other position must clear tau on its own, so no argmax compares the confidences of two differently
calibrated predictors (with ``shift_logits`` the leftmost masked position reads its committed
predecessor's clean row, the AR head, and the others mostly their own MASK rows): at tau > 1 the sampler
decodes left to right. The active set arrives packed in ascending position (every sampler's
:func:`~.base.pack` order). Rows are processed together; inactive slots carry ``active = False``.

``commit_rule="auto"`` (the default, :func:`resolve_rule`) is "leftmost" for a SetDLM read with the AR head
shift (an AR model adapted with ``model.shift_logits``: the setting where the measurements in
``docs/results.md`` favour it at every tau) and the paper's "confidence" for everything else.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter over the last dim: tokens whose preceding cumulative mass is < top_p survive."""
    if top_p >= 1.0:
        return probs
    sp, si = probs.sort(-1, descending=True)
    keep = (sp.cumsum(-1) - sp) < top_p                   # keeps the token that crosses top_p
    keep[..., 0] = True                                   # and the most probable (top_p below float32's range)
    out = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    return out / out.sum(-1, keepdim=True)


def min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Tokens whose probability is >= min_p times the most probable one's survive (the top token always);
    renormalised over the last dim. The ratio is unchanged by an earlier renormalisation (after top_p)."""
    if min_p <= 0.0:
        return probs
    out = probs * (probs >= min_p * probs.amax(-1, keepdim=True))
    return out / out.sum(-1, keepdim=True)


def choose_tokens(logits: torch.Tensor, banned: list[int], temperature: float = 0.0, top_p: float = 1.0,
                  generator=None, counts: list[int] | None = None, min_p: float = 0.0):
    """logits [..., V] -> (tokens [...], confidence [...]) in fp32. ``generator``: one torch.Generator, or one per
    row of logits [B, A, V] (with ``counts``: row b draws for its first counts[b] entries only, the rest are
    argmax), so a row's draws do not depend on the other rows of the batch."""
    logits = logits.float().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    if banned:
        idx = torch.tensor(sorted(set(banned)), device=logits.device)
        logits = logits.index_fill(-1, idx, float("-inf"))
    if temperature > 0:                   # the maximum first, a float32 divisor: no overflow at any temperature
        logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    probs = min_p_filter(top_p_filter(torch.softmax(logits, -1), top_p), min_p)
    if temperature <= 0:
        conf, tok = probs.max(-1)
        return tok, conf
    if isinstance(generator, (list, tuple)):
        tok = probs.argmax(-1)
        for b, g in enumerate(generator):
            n = probs.shape[1] if counts is None else counts[b]
            if n:
                tok[b, :n] = torch.multinomial(probs[b, :n], 1, generator=g)[:, 0]
    else:
        flat = probs.reshape(-1, probs.shape[-1])
        tok = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    conf = probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    return tok, conf


class RowOptions(NamedTuple):
    """A row's own sampling options (a shared serving session holds requests that differ in them): each field is
    the GenerationConfig field of its name; :meth:`choice` is what :func:`choose_tokens` takes of them."""
    temperature: float
    top_p: float
    repetition_penalty: float
    min_p: float = 0.0

    @classmethod
    def of(cls, cfg) -> "RowOptions":
        return cls(*(float(getattr(cfg, name)) for name in cls._fields))

    def choice(self) -> dict:
        """The keyword arguments of :func:`choose_tokens` (the token choice's options)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p}


COMMIT_RULES = ("confidence", "leftmost")


def resolve_rule(rule: str, anchored: bool) -> str:
    """``rule``, with "auto" resolved: "leftmost" when ``anchored`` (a SetDLM read with the AR head shift), else
    "confidence" (module docstring)."""
    if rule != "auto":
        return rule
    return "leftmost" if anchored else "confidence"


def commit_mask(conf: torch.Tensor, active: torch.Tensor, tau: float, k: int = 1,
                rule: str = "confidence") -> torch.Tensor:
    """conf, active [B, A] (packed in ascending position) -> bool [B, A]: the k forced commits of ``rule`` (the
    most confident, or the leftmost active positions), plus conf >= tau."""
    if rule == "leftmost":
        rank = active.long().cumsum(-1) - 1
    else:
        c = torch.where(active, conf, torch.full_like(conf, float("-inf")))
        order = torch.sort(c, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order,
                                                torch.arange(c.shape[-1], device=c.device).expand_as(order))
    return active & ((rank < k) | (conf >= tau))


__all__ = ["choose_tokens", "commit_mask", "top_p_filter", "min_p_filter", "COMMIT_RULES", "resolve_rule"]
