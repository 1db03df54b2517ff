"""What makes a quest infill succeed or fail: where the first commits in the masked span land, how confident
they are, and which goal the fill names (the reproduction's diagnostics, issue 31).

A quest masks sentences 2-4 (oracle length m), which are a function of the goal g (one of 8, ``corpus.GOALS``)
alone; sentence 5 names g, so a model that reads the suffix can fill the span exactly. Each quest is decoded
once more, both sides visible, with ``record=True`` (each span token's commit call s_j and confidence c_j, j =
0..m-1; :class:`~setdiff_mega.decoding.base.GenerationOutput`), and measured:

* **first commit**: the offset j* = argmin_j s_j (the leftmost of the first call's tokens), j* / (m - 1) in
  [0, 1], and c_{j*};
* **goal token**: the first span position k where the eight goals' middles differ (after "The plan was to"):
  its rank among the span's commits (r_k = #{j : s_j < s_k}; 0 = committed first), its confidence c_k, and
  whether the token equals the reference's;
* **goal named**: g' with "The plan was to {GOALS[g'][0]}." in the fill, or none; right when g' = g.

Rows are aggregated per model (tag, seed): exact match, the fractions naming the right / a wrong / no goal,
the means above, and exact match given the goal token right. Decoding settings: the infill preset with
:data:`~.frontier.INFILL_OVERRIDES`, at W = D (SetDLM) or the method's own (BD3LM, MDLM), as in the
infilling table's both-sides rows.
"""
from __future__ import annotations

import dataclasses
import statistics

from setdiff_mega import methods
from setdiff_mega.data.corpus import GOALS
from setdiff_mega.eval.tasks import story_infill
from setdiff_mega.inference.options import generation_config

from .frontier import INFILL_OVERRIDES


def middle(g: int) -> str:
    """Sentences 2-4 of a quest with goal ``g`` (``corpus._quest``)."""
    goal, attempt, problem, fix, _outcome, _feeling = GOALS[g]
    return f"The plan was to {goal}. Our hero {attempt}, but {problem}. Then our hero {fix}."


def goal_position(tok) -> int:
    """The first span token where the eight goals' middles differ (as ``story_infill`` encodes a span)."""
    ids = [tok.encode(" " + middle(g)) for g in range(len(GOALS))]
    k = 0
    while all(len(t) > k for t in ids) and len({t[k] for t in ids}) == 1:
        k += 1
    return k


def named_goal(text: str) -> int | None:
    hits = [g for g, row in enumerate(GOALS) if f"The plan was to {row[0]}." in text]
    return hits[0] if len(hits) == 1 else None


def example(rec: dict, goal: int, k: int, ref_ids: list[int]) -> dict:
    """One decoded quest (a ``story_infill`` record) -> the measurements of the module docstring."""
    steps, conf, toks = rec["commit_steps"], rec["confidences"], rec["tokens"]
    m = len(steps)
    first = min(range(m), key=lambda j: (steps[j], j)) if m else None
    named = named_goal(rec["generated"])
    out = {"correct": rec["correct"], "span": m, "goal": goal, "named": named,
           "first_offset": first, "first_relative": (first / (m - 1) if m > 1 else 0.0) if m else None,
           "first_confidence": conf[first] if m else None}
    if k < m:
        out.update(goal_rank=sum(1 for s in steps if s < steps[k]), goal_confidence=conf[k],
                   goal_token_right=k < len(ref_ids) and toks[k] == ref_ids[k])
    return out


def _mean(vals: list) -> float | None:
    vals = [float(v) for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None


def summarise(m: dict, tag: str, rows: list[dict]) -> dict:
    """The per-model row of the diagnostics table."""
    n = max(len(rows), 1)
    right = [r for r in rows if r.get("goal_token_right")]
    return {"tag": tag, **m, "n": len(rows), "exact_match": sum(r["correct"] for r in rows) / n,
            "goal_right": sum(r["named"] == r["goal"] for r in rows) / n,
            "goal_wrong": sum(r["named"] is not None and r["named"] != r["goal"] for r in rows) / n,
            "goal_none": sum(r["named"] is None for r in rows) / n,
            "first_relative": _mean([r["first_relative"] for r in rows]),
            "first_confidence": _mean([r["first_confidence"] for r in rows]),
            "goal_rank": _mean([r.get("goal_rank") for r in rows]),
            "goal_confidence": _mean([r.get("goal_confidence") for r in rows]),
            "goal_confidence_right": _mean([r.get("goal_confidence") for r in right]),
            "goal_confidence_wrong": _mean([r.get("goal_confidence") for r in rows
                                            if "goal_token_right" in r and not r["goal_token_right"]]),
            "goal_token_right": _mean([r.get("goal_token_right") for r in rows]),
            "exact_given_goal_right": (sum(r["correct"] for r in right) / len(right)) if right else None}


def probe(m: dict, tag: str, loaded: tuple, rows: list[dict], batch_size: int) -> dict | None:
    """Decode the quests of ``rows`` (both sides; W = D for a windowed method) with ``record=True`` and
    summarise; None for a causal method (it cannot see the suffix)."""
    model, objective, tok, cfg = loaded
    rec = methods.get(m["objective"])
    if rec.causal:
        return None
    over = {"max_new_tokens": 64, **INFILL_OVERRIDES["quests"], **({"window": m["D"]} if rec.window else {})}
    gc = dataclasses.replace(generation_config(cfg.objective, cfg.data.seq_length, "infill", over), record=True)
    r = story_infill(model, tok, objective, rows, gc, cfg.data.seq_length, batch_size, task="quests", record=True)
    k = goal_position(tok)
    ex = [example(x, rows[x["row"]]["goal"], k, tok.encode(" " + x["reference"])) for x in r["records"]]
    return summarise(m, tag, ex)


__all__ = ["middle", "goal_position", "named_goal", "example", "summarise", "probe"]
