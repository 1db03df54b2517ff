"""Training: the loop, the optimizer backend, AdamW and LR schedules, metric loggers, estimates and benchmarks.

The package's names resolve on first use (PEP 562), so that importing one light module of it
(``training.flops``, say, for a sweep's plan) does not import the trainer and megatron-core with it.
"""
from setdiff_mega.lazy import lazy_exports

_EXPORTS = {"build_optimizer": "optim", "lr_at": "optim", "TrainingError": "guard", "TrainResult": "trainer",
            "evaluate": "step", "objective_from_config": "trainer", "train": "trainer"}

__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
