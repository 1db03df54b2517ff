"""Checkpoints: the directory protocol (io), sharded model / optimizer state (sharded), models from
checkpoints (native), the training-checkpoint manager (manager) and the run directory (rundir), the Hugging
Face format (hf) and the conversions to and from it (convert).

The package's names resolve on first use (PEP 562): importing ``checkpoint.io`` (the protocol, light) does
not import the model stack with ``checkpoint.native``.
"""
import importlib

_EXPORTS = {"CheckpointError": "io", "latest_checkpoint": "io", "read_state": "io", "resolve_checkpoint": "io",
            "full_state_dict": "native", "load_model": "native", "load_weights": "native",
            "save_model_checkpoint": "native"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
