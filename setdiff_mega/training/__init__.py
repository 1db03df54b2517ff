"""Training: the loop, the optimizer backend, AdamW and LR schedules, metric loggers, estimates and benchmarks.

The package's names resolve on first use (PEP 562), so that importing one light module of it
(``training.flops``, say, for a sweep's plan) does not import the trainer and megatron-core with it.
"""
import importlib

_EXPORTS = {"build_optimizer": "optim", "lr_at": "optim", "TrainingError": "guard", "TrainResult": "trainer",
            "evaluate": "step", "objective_from_config": "trainer", "train": "trainer"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
