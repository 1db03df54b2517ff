"""Decoding policies of the planning study: which positions each method fills first, as sampler options.

Every policy is a set of :class:`~setdiff_mega.decoding.config.GenerationConfig` fields the samplers already
take (``commit_rule``: ``confidence`` = most-confident-first, ``leftmost`` = left to right; ``commit_k``: tokens
always committed per step; ``tau``: also commit every token at least this confident, 1e6 = never; ``window``:
SetDLM's W; ``block_size``: MDLM's semi-autoregressive block, here the whole answer so the order is global):

    AR        left to right, one token per step (its only order)
    MDLM      most-confident-first and left to right over the whole answer, k = 1 and k = 2 per step; and
              most-confident-first with tau = 0.9 (Kim et al.'s adaptive order)
    BD3LM     inside each block of S: most-confident-first or left to right, k = 1, and tau = 0.9
    SetDLM    W in {D, 2D} x tau in {0.9, 1e6} x {most-confident-first, leftmost}: the window lets it commit out
              of order only near the frontier

The answer has a fixed length per level (``answer_chars``), so ``max_new_tokens`` = answer + EOS and MDLM's one
block spans exactly that canvas.
"""
from __future__ import annotations

from setdiff_mega import diffusion, methods  # noqa: F401  (diffusion: the built-in methods register)

NEVER = 1e6


def _name(p: dict) -> str:
    rule = {"confidence": "confident-first", "leftmost": "left-to-right"}[p["commit_rule"]]
    parts = [rule]
    if "window" in p:
        parts.append(f"W={p['window']}")
    parts.append(f"k={p['commit_k']}" if p["tau"] >= NEVER else f"tau={p['tau']:g}")
    return ", ".join(parts)


def policies(method: dict, answer_tokens: int) -> list[dict]:
    """[{name, options}] for ``method`` (objective + its fields) on an answer of ``answer_tokens`` (EOS
    included)."""
    rec = methods.get(method["objective"])          # what the method's registry record says it can do
    base = {"max_new_tokens": answer_tokens, "temperature": 0.0}
    if rec.causal:
        out = [{"commit_rule": "leftmost", "commit_k": 1, "tau": NEVER}]
    elif rec.window:
        out = [{"window": w, "commit_rule": r, "commit_k": 1, "tau": t}
               for w in (method["D"], 2 * method["D"]) for t in (0.9, NEVER) for r in ("confidence", "leftmost")]
    elif "block_size" in rec.run_fields:            # blocks fixed by training (BD3LM)
        out = [{"block_size": method["block_size"], "commit_rule": r, "commit_k": 1, "tau": NEVER}
               for r in ("confidence", "leftmost")]
        out.append({"block_size": method["block_size"], "commit_rule": "confidence", "commit_k": 1, "tau": 0.9})
    else:                                            # one canvas, any order (MDLM)
        glob = {"block_size": answer_tokens}
        out = [{**glob, "commit_rule": r, "commit_k": k, "tau": NEVER}
               for r in ("confidence", "leftmost") for k in (1, 2)]
        out.append({**glob, "commit_rule": "confidence", "commit_k": 1, "tau": 0.9})
    return [{"name": _name(p), "options": {**base, **p}} for p in out]


__all__ = ["policies", "NEVER"]
