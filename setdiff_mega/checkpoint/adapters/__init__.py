"""Architecture adapters: one module per Hugging Face family (:mod:`.llama` (and Mistral), :mod:`.qwen2`,
:mod:`.qwen3` (and setdlms' Qwen3-backbone releases), the reference's DiT releases :mod:`.dit`, the
project's own export :mod:`.setdlm`), each an :class:`~.base.Adapter` record with its
config map and its name / shape map (:mod:`.layout`, read in both directions); :mod:`.weights` reads a
directory's tensors lazily, shard by shard. :func:`detect` picks the adapter of a ``config.json``
(``model_type``, then ``architectures``); an unknown or remote-code-only architecture is one line listing
the supported ones. Adding a family = one module + its entry in :data:`FAMILIES`
(``docs/architecture.md``, "How to add an architecture adapter")."""
from __future__ import annotations

from setdiff_mega.errors import CheckpointError

from . import dit, llama, qwen2, qwen3, setdlm
from .base import Adapter

FAMILIES: tuple = (*llama.ADAPTERS, *qwen2.ADAPTERS, *qwen3.ADAPTERS, *dit.ADAPTERS, *setdlm.ADAPTERS)


def names() -> list:
    return [a.name for a in FAMILIES]


def get(name: str) -> Adapter:
    for a in FAMILIES:
        if a.name == name:
            return a
    raise CheckpointError(f"no architecture adapter named '{name}' (supported: {', '.join(names())})")


def supported() -> str:
    return ", ".join(f"{a.name} ({'/'.join(a.architectures)})" for a in FAMILIES)


def detect(raw: dict, source: str, names=()) -> Adapter:
    """The adapter of a ``config.json`` (its ``model_type``, else its ``architectures``; adapters sharing a
    ``model_type`` decide by the tensor ``names``)."""
    model_type, archs = raw.get("model_type"), list(raw.get("architectures") or [])
    sharing = [a for a in FAMILIES if model_type in a.model_types]
    if len(sharing) == 1:
        return sharing[0]
    for a in sharing:
        if a.claims is not None and a.claims(raw, set(names)):
            return a
    if sharing:
        raise CheckpointError(f"{source}: model_type '{model_type}' is shared by {', '.join(a.name for a in sharing)} "
                              f"and the weights match none of their layouts")
    for a in FAMILIES:
        if set(archs) & set(a.architectures):
            return a
    what = f"model_type '{model_type}'" + (f" ({', '.join(archs)})" if archs else "")
    if raw.get("auto_map"):
        raise CheckpointError(f"{source}: {what} is defined only by remote code (auto_map), which is never "
                              f"executed; supported architectures: {supported()}")
    raise CheckpointError(f"{source}: {what} is not a supported architecture; supported: {supported()}")


__all__ = ["Adapter", "FAMILIES", "names", "get", "detect", "supported"]
