"""Checkpoints: atomic save / publish / load of model, optimizer, data position, RNG and config."""
from .io import CheckpointError, latest_checkpoint, load_checkpoint, load_model, save_checkpoint

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "load_model"]
