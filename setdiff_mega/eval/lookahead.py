"""Lookahead: how far past the true prefix one decoding step is right (teacher-forced window accuracy).

A windowed sampler (SetDLM) can commit several tokens in one step only where the model's argmax is right at
the positions after the leftmost; tokens per step are bounded by how often it is. This measures it on
(prompt, response) records, rendered as training data lays them out (:meth:`ChatRenderer.encode` with the
checkpoint's chat template, or the plain ``[BOS] prompt response [EOS]`` layout without one): the targets
``t_0 .. t_{A-1}`` are the response's tokens up to and including the first EOS (what a decode delivers: the
sampler stops there; a template's end-of-turn markup after it is never decoded).

For every record and every ``j < A`` the decoder is given the prompt and ``t_<j`` and takes **one** step that
commits every position of the window ``[j, j + K)`` (``window = max_new_tokens = K``, ``tau = 0``, EOS not
stopping the row: the step's argmax at each position, exactly what the sampler would commit there). With
``x_{j,k}`` the token committed at offset ``k`` and ``c_{j,k}`` its confidence (softmax probability):

    acc_k      = mean over (record, j) with j + k < A of [x_{j,k} = t_{j+k}]
    conf_k     = the mean of c_{j,k} over the same pairs (acc_k far below conf_k: over-confident there)
    run(j)     = the number of leading offsets right, min(K, A - j) at most
    mean run   = mean over (record, j) of run(j): how many tokens a step at j commits and keeps the
                 reference answer when a rule commits exactly the right leading ones; over the prefixes
                 a decode on the reference path visits, its steps deliver max(1, run) tokens each while
                 they are right, so a mean run near 1 says no confidence rule decodes this answer in
                 fewer steps (a per-prefix mean, not per visited prefix: an estimate, not a bound)

Offset 0 is the leftmost position: with the AR head shift (method.md 13) it reads the AR row of ``t_{j-1}``,
so ``acc_0`` is teacher-forced next-token accuracy; offsets >= 1 read MASK rows only. A causal method (AR)
decodes one token per step: its lookahead is ``K = 1`` (``acc_0``: its next-token accuracy, the comparison).
A block method (BD3LM, MDLM) decodes aligned blocks, not a window from the prefix: refused with one line.
Deterministic: greedy (temperature 0), no sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from setdiff_mega import methods
from setdiff_mega.decoding.base import Canvas
from setdiff_mega.inference.api import build_sampler, check_vocab
from setdiff_mega.inference.options import generation_config


class LookaheadError(ValueError):
    """A model or request this measurement cannot take (the message names the fix)."""


@dataclass
class Lookahead:
    K: int
    acc: list            # [K] acc_k
    conf: list           # [K] conf_k
    count: list          # [K] (record, j) pairs scored at offset k
    mean_run: float
    records: int
    steps: int           # one-step decodes (sum of A over records)


def targets(renderer, tok, record: dict, where: str = "lookahead record") -> tuple[list[int], list[int]]:
    """(prompt ids, target ids) of one record laid out as its training data (module docstring); ``where``
    names the record in an error (``file:line``)."""
    if renderer is None:
        return [tok.bos] + tok.encode(record["prompt"]), tok.encode(record["response"]) + [tok.eos]
    ids, mask = renderer.encode(record, lambda: where)
    ids, mask = ids.tolist(), mask.tolist()
    first = mask.index(1)
    if not all(mask[first:]):
        raise LookaheadError(f"{where}: lookahead scores one response after its prompt: give prompt / response "
                             "records (a single assistant turn)")
    tgt = ids[first:]
    return ids[:first], tgt[:tgt.index(tok.eos) + 1] if tok.eos in tgt else tgt


def window_of(objective_name: str, K: int) -> int:
    """The window a lookahead of ``K`` decodes with (module docstring: causal 1, windowed K, else refused)."""
    m = methods.get(objective_name)
    if m.causal:
        return 1
    if not m.window:
        raise LookaheadError(f"lookahead measures a window from the true prefix; {m.label} decodes aligned blocks: "
                             f"measure a windowed (SetDLM) or causal (AR) checkpoint")
    if K < 1:
        raise LookaheadError(f"the lookahead K must be >= 1 (got {K})")
    return K


def _steps(record_targets: list) -> list[tuple[int, int, list[int]]]:
    """[(record index, j, the ids given)] of every one-step decode."""
    return [(i, j, prompt + tgt[:j]) for i, (prompt, tgt) in enumerate(record_targets) for j in range(len(tgt))]


def measure(model, tok, objective, cfg, records: list[dict], K: int = 4, batch_size: int = 16,
            renderer=None, progress=None, wheres: list[str] | None = None) -> Lookahead:
    """:class:`Lookahead` of ``records`` (module docstring); ``cfg`` the checkpoint's config (its length L),
    ``renderer`` the chat template's :class:`~setdiff_mega.data.chat.ChatRenderer` (None: plain layout),
    ``wheres`` each record's name for errors (``file:line``; default its index)."""
    wheres = wheres or [f"lookahead record {i}" for i in range(len(records))]
    per = [targets(renderer, tok, r, w) for r, w in zip(records, wheres)]
    return measure_ids(model, tok, objective, cfg, per, K, batch_size, progress)


def measure_ids(model, tok, objective, cfg, per: list[tuple[list[int], list[int]]], K: int = 4,
                batch_size: int = 16, progress=None) -> Lookahead:
    """:func:`measure` on token ids: ``per`` = [(prompt ids, target ids)]."""
    K = window_of(objective.name, K)
    check_vocab(model, tok)
    model.eval()
    L = cfg.data.seq_length
    if not per or not all(t for _, t in per):
        raise LookaheadError("lookahead needs records with a non-empty response")
    longest = max(len(p) + len(t) - 1 + K for p, t in per)
    if longest > L:
        raise LookaheadError(f"a record's prompt and response ({longest - K + 1} tokens) and the window ({K}) do not "
                             f"fit the model's length L = {L}: drop the longest records or measure a smaller K")
    gc = generation_config(cfg.objective, L, None, {"max_new_tokens": K, "window": K, "tau": 0.0,
                                                     "temperature": 0.0, "stop_at_eos": False, "record": True})
    sampler = build_sampler(objective, model, tok, gc)
    right, conf, count, runs = torch.zeros(K), torch.zeros(K), torch.zeros(K), 0
    steps = _steps(per)
    dev = next(model.parameters()).device
    with torch.no_grad():
        for s in range(0, len(steps), batch_size):
            chunk = steps[s:s + batch_size]
            out = sampler.generate(Canvas.from_prompts([ids for _, _, ids in chunk], tok.mask, tok.pad, K,
                                                       device=dev))
            for b, (i, j, _) in enumerate(chunk):
                gold = per[i][1][j:j + K]
                n = len(gold)
                if len(out.tokens[b]) < n:
                    raise LookaheadError(f"one step committed {len(out.tokens[b])} of the window's {n} positions: "
                                         f"the sampler does not commit a whole window at tau = 0")
                ok = [int(g == x) for g, x in zip(gold, out.tokens[b])]
                right[:n] += torch.tensor(ok, dtype=torch.float32)
                conf[:n] += torch.tensor(out.confidences[b][:n], dtype=torch.float32)
                count[:n] += 1
                runs += next((k for k, v in enumerate(ok) if not v), n)
            if progress is not None:
                progress(len(chunk))
    safe = count.clamp(min=1)
    return Lookahead(K, (right / safe).tolist(), (conf / safe).tolist(), count.long().tolist(), runs / len(steps),
                     len(per), len(steps))


__all__ = ["Lookahead", "LookaheadError", "measure", "measure_ids", "targets", "window_of"]
