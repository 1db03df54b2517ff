"""Training: the loop, optimizer and LR schedules, metric loggers."""
from .optim import build_optimizer, lr_at
from .trainer import TrainingError, TrainResult, evaluate, objective_from_config, train

__all__ = ["train", "evaluate", "TrainResult", "TrainingError", "objective_from_config", "build_optimizer", "lr_at"]
