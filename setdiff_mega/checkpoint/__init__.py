"""Checkpoints: the directory protocol (io), sharded model / optimizer state (sharded), models from
checkpoints (native), the training-checkpoint manager (manager) and the run directory (rundir), the Hugging
Face format (hf) and the conversions to and from it (convert), the Hugging Face families in and out
(families, with one adapter per architecture in adapters), and ``train.init_from=hf:DIR`` (hf_init).

The package's names resolve on first use (PEP 562): importing ``checkpoint.io`` (the protocol, light) does
not import the model stack with ``checkpoint.native``.
"""
from setdiff_mega.lazy import lazy_exports

_EXPORTS = {"CheckpointError": "io", "latest_checkpoint": "io", "read_state": "io", "resolve_checkpoint": "io",
            "full_state_dict": "native", "load_model": "native", "load_weights": "native",
            "save_model_checkpoint": "native", "adopt_architecture": "native"}

__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
