"""Checkpoints: the directory protocol (io), sharded model/optimizer state (sharded), models from
checkpoints (native), the Hugging Face format (hf) and the conversions to and from it (convert)."""
from .io import CheckpointError, latest_checkpoint, read_state, resolve_checkpoint
from .native import full_state_dict, load_model, load_weights, save_model_checkpoint

__all__ = ["CheckpointError", "latest_checkpoint", "resolve_checkpoint", "read_state", "load_model",
           "load_weights", "save_model_checkpoint", "full_state_dict"]
