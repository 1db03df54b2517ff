"""A scheduler step's forwards: every decode's calls run as fused forwards of the model, their logits handed back
per decode.

    fused_forwards(work, clock, pad, min_saving, drop) -> [(decode, [logits])]

Cached and uncached calls run apart (:func:`~setdiff_mega.decoding.calls.fused_forward` takes one kind), and the
cached ones are cut by width where that saves padding (:mod:`.fusion`: a joining row's prefill apart from the
decoding rows; the wide forward first); each decode's logits are stitched back from the parts of its call. A
failure fails only the decodes it touches (``drop(decode, 500, message)``: its jobs end with that one line); the
step goes on with the others. :class:`Clocked` is the model with its forwards timed (the step's ``forward`` part,
:data:`.scheduler.PARTS`).
"""
from __future__ import annotations

import time

import torch

from setdiff_mega.decoding.calls import fused_forward

from .fusion import groups, split_rows, stitch


def fused_forwards(work: list, clock, pad: int, min_saving: int, drop) -> list:
    """``work`` [(decode, calls)] -> [(decode, [logits])] for the decodes whose forwards succeeded (module
    docstring); ``clock`` the (timed) model, ``pad`` the tokenizer's pad id."""
    parts, failed = [], set()                # (work index, part of its call)

    def fail(i: int, e: Exception, what: str) -> None:
        if i not in failed:
            failed.add(i)
            drop(work[i][0], 500, f"{what}: {type(e).__name__}: {e}")
    for i, (d, calls) in enumerate(work):
        try:
            parts += [(i, p) for p in split_rows(calls[0], min_saving)]
        except Exception as e:                # noqa: BLE001 (this decode fails; the step goes on)
            fail(i, e, "the decode's forward could not be arranged")
    results: dict = {}
    for cached in (True, False):
        mine = [(i, p) for i, p in parts if (p[0].cache is not None) == cached]
        try:
            cuts = groups([p[0] for _, p in mine], min_saving) if mine else []
        except Exception:                     # noqa: BLE001 (no cut: one forward, as without fusion)
            cuts = [list(range(len(mine)))]
        for group in cuts:
            members = [mine[j] for j in group]
            try:
                outs = fused_forward(clock, [p[0] for _, p in members], pad)
            except Exception as e:            # noqa: BLE001 (the decodes of this forward fail; the loop goes on)
                for i, _ in members:
                    fail(i, e, "the decode forward failed")
                continue
            for (i, (_, rows, cols)), o in zip(members, outs):
                results.setdefault(i, []).append((o, rows, cols))
    out = []
    for i, (d, calls) in enumerate(work):
        if i in failed or i not in results:
            continue
        try:
            out.append((d, [stitch(calls[0], results[i])]))
        except Exception as e:                # noqa: BLE001
            fail(i, e, "the decode's logits could not be assembled")
    return out


class Clocked:
    """The model, its forwards timed (``seconds``; on CUDA up to the device's completion)."""

    def __init__(self, model):
        self.model, self.seconds = model, 0.0
        self.cuda = next(model.parameters()).device.type == "cuda"
        self.ragged = getattr(model, "ragged", False)

    def use_cache(self, cache):
        return self.model.use_cache(cache)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.model(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t
        return out


__all__ = ["fused_forwards", "Clocked"]
