"""The project's own export (``model_type`` setdlm, :mod:`setdiff_mega.checkpoint.hf`): its ``config.json``
carries the whole training config, its weights transformers' decoder layout with the padded vocabulary
rows kept. Imported by :func:`setdiff_mega.checkpoint.convert.import_export` (exactly, with its step)."""
from __future__ import annotations

from dataclasses import asdict

from setdiff_mega.config import from_dict
from setdiff_mega.errors import CheckpointError

from .base import Adapter


def setdlm_model(hf: dict, source: str, shapes: dict) -> dict:
    if not hf.get("setdiff_mega"):
        raise CheckpointError(f"{source} lacks the 'setdiff_mega' training config; it was not written by "
                              f"tools/convert_checkpoint.py")
    return asdict(from_dict(hf["setdiff_mega"]).model)


ADAPTER = Adapter("setdlm", ("setdlm",), ("SetDLMForDiffusionLM",), setdlm_model, exact_vocab=False,
                  transformers_config=False, native=True)
ADAPTERS = (ADAPTER,)

__all__ = ["ADAPTERS", "ADAPTER"]
