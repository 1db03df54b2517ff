"""Architecture adapters: one module per Hugging Face family (:mod:`.llama` (and Mistral), :mod:`.qwen2`,
:mod:`.qwen3`, the project's own export :mod:`.setdlm`), each an :class:`~.base.Adapter` record with its
config map and its name / shape map (:mod:`.layout`, read in both directions); :mod:`.weights` reads a
directory's tensors lazily, shard by shard. :func:`detect` picks the adapter of a ``config.json``
(``model_type``, then ``architectures``); an unknown or remote-code-only architecture is one line listing
the supported ones. Adding a family = one module + its entry in :data:`FAMILIES`
(``docs/architecture.md``, "How to add an architecture adapter")."""
from __future__ import annotations

from setdiff_mega.errors import CheckpointError

from . import llama, qwen2, qwen3, setdlm
from .base import Adapter

FAMILIES: tuple = (*llama.ADAPTERS, *qwen2.ADAPTERS, *qwen3.ADAPTERS, *setdlm.ADAPTERS)


def names() -> list:
    return [a.name for a in FAMILIES]


def get(name: str) -> Adapter:
    for a in FAMILIES:
        if a.name == name:
            return a
    raise CheckpointError(f"no architecture adapter named '{name}' (supported: {', '.join(names())})")


def supported() -> str:
    return ", ".join(f"{a.name} ({'/'.join(a.architectures)})" for a in FAMILIES)


def detect(raw: dict, source: str) -> Adapter:
    """The adapter of a ``config.json`` (its ``model_type``, else its ``architectures``)."""
    model_type, archs = raw.get("model_type"), list(raw.get("architectures") or [])
    for a in FAMILIES:
        if model_type in a.model_types:
            return a
    for a in FAMILIES:
        if set(archs) & set(a.architectures):
            return a
    what = f"model_type '{model_type}'" + (f" ({', '.join(archs)})" if archs else "")
    if raw.get("auto_map"):
        raise CheckpointError(f"{source}: {what} is defined only by remote code (auto_map), which is never "
                              f"executed; supported architectures: {supported()}")
    raise CheckpointError(f"{source}: {what} is not a supported architecture; supported: {supported()}")


__all__ = ["Adapter", "FAMILIES", "names", "get", "detect", "supported"]
