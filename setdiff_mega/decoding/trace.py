"""The decoding trace: which token was written where, at which step, how confidently, inside which window or
block (a documented structure with a JSON form; ``record=True`` collects it, every sampler and both engines).

For one row of a decode, with G generated tokens in canvas order:

    positions[i]     canvas position of generated token i (the generation region: after the prompt, or the
                     MASK spans of an infill)
    tokens[i]        the token id
    steps[i]         the 0-based decode step (model call) that committed it
    confidences[i]   p(token) under the sampler's processed distribution when it was committed (1.0 for AR
                     greedy is not assumed: what the sampler read)
    drafts           speculative decoding only (decoding/speculative.py): each step's verified drafts, how many
                     were accepted, the first rejected one and the AR head's correction there
    window[i]        the first position of the window / block the token was committed from: for SetDLM the
                     leftmost position still masked when its step began (the window's start), for BD3LM / MDLM
                     the first position of its block, for AR the position itself

``window`` is derived from the other fields for SetDLM and AR (the leftmost position still masked at step s is
the smallest position committed at a step >= s) and from ``block_size`` for the block methods: those whose
registry record (``setdiff_mega.methods.Method``) says ``block``. :func:`traces` takes the record, or any object
with ``name`` and ``block`` (the export builds one from its config.json), or a registered method's name
(:func:`describe`, called by the registry for every record it holds: this module names no method).
:meth:`DecodeTrace.replay` rebuilds the canvas after every step from the commits alone; the trace is exact when
its last frame holds the generated tokens and every frame equals the sampler's recorded canvas (tests).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

MASK_FRAME = -1          # a position still masked in a replayed frame


@dataclass
class DecodeTrace:
    method: str
    prompt: list[int]                    # the canvas before decoding (MASK where tokens are to be generated)
    positions: list[int]
    tokens: list[int]
    steps: list[int]
    confidences: list[float]
    window: list[int] = field(default_factory=list)
    options: dict = field(default_factory=dict)     # the decoding options that shape the picture (window, tau, ...)
    texts: list[str] = field(default_factory=list)  # each token's text (filled in by a caller with a tokenizer)
    drafts: list[dict] = field(default_factory=list)  # speculative decoding: per verifying step, the drafts it
                                                    # checked {step, positions, tokens, accepted (the leading run),
                                                    # rejected (the first rejected position or None), correction}

    @property
    def num_steps(self) -> int:
        return max(self.steps) + 1 if self.steps else 0

    def replay(self) -> list[list[int]]:
        """The generated positions after each step (``MASK_FRAME`` where still masked), from the commits alone:
        frames[s][j] is the token at ``positions[j]`` after step s."""
        order = sorted(range(len(self.steps)), key=lambda i: self.steps[i])
        frame, frames, k = [MASK_FRAME] * len(self.tokens), [], 0
        for s in range(self.num_steps):
            while k < len(order) and self.steps[order[k]] == s:
                frame[order[k]] = self.tokens[order[k]]
                k += 1
            frames.append(list(frame))
        return frames

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "DecodeTrace":
        data = json.loads(text)
        missing = [k for k in ("method", "prompt", "positions", "tokens", "steps", "confidences") if k not in data]
        if missing:
            raise ValueError(f"not a decoding trace: the fields {', '.join(missing)} are missing")
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


_RECORDS: dict = {}                 # name -> registry record, filled by setdiff_mega.methods.register


def describe(record) -> None:
    """Make a method's record (``name``, ``block``) known by its name (the registry does, for every record)."""
    _RECORDS[record.name] = record


def forget(name: str) -> None:
    _RECORDS.pop(name, None)


def _record(method):
    """(name, decodes in blocks) of a record or a registered name (an unknown name: not in blocks)."""
    rec = method if hasattr(method, "block") else _RECORDS.get(method)
    return getattr(rec, "name", method), bool(getattr(rec, "block", False))


def window_starts(positions: list[int], steps: list[int], method, block_size: int | None,
                  start: int) -> list[int]:
    """Each token's window / block start (module docstring); ``start``: the generation region's first position;
    ``method``: its record or registered name (:func:`traces`)."""
    if _record(method)[1] and block_size:
        return [start + (p - start) // block_size * block_size for p in positions]
    first: dict[int, int] = {}                       # step -> leftmost position committed at a step >= it
    low = None
    for s in sorted(set(steps), reverse=True):
        here = min(p for p, t in zip(positions, steps) if t == s)
        low = here if low is None else min(low, here)
        first[s] = low
    return [first[s] for s in steps]


def traces(method, canvas, out, cfg) -> list[DecodeTrace]:
    """One trace per row of a recorded decode (``cfg.record``): canvas [B, N] (the decode's input) and its
    GenerationOutput; ``method``: the registry record, an object with ``name`` and ``block``, or a registered
    name (module docstring)."""
    result = []
    name = _record(method)[0]
    drafts = getattr(out, "speculation", {}).get("drafts") or [[] for _ in out.tokens]
    for b in range(len(out.tokens)):
        positions = [int(p) for p in out.positions[b]]
        start = positions[0] if positions else 0
        prompt = [int(t) for t, v in zip(canvas.tokens[b].tolist(), canvas.valid[b].tolist()) if v]
        result.append(DecodeTrace(
            method=name, prompt=prompt, positions=list(positions), tokens=list(out.tokens[b]),
            steps=[int(s) for s in out.commit_steps[b]], confidences=[float(c) for c in out.confidences[b]],
            window=window_starts(positions, out.commit_steps[b], method, cfg.block_size, start), drafts=drafts[b],
            options={k: getattr(cfg, k) for k in ("window", "tau", "commit_k", "commit_rule", "block_size",
                                                  "temperature", "top_p") if hasattr(cfg, k)}
                     | ({"speculative": True} if getattr(cfg, "speculative", False) else {})))
    return result


__all__ = ["DecodeTrace", "traces", "window_starts", "describe", "forget", "MASK_FRAME"]
