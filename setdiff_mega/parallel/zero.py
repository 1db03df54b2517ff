"""DeepSpeed ZeRO (stages 1-3) for the optimizer, on top of megatron-core's TP / DP groups.

``train.zero_stage > 0`` wraps the model and the project's AdamW (same parameter groups) in a DeepSpeed
engine: ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 also parameters, across the
data-parallel group with its context-parallel ranks (DP x CP). DeepSpeed sees megatron-core's groups
through :class:`McoreMPU` (its "mpu" protocol: model parallel = tensor parallel), so gradient norms and
reductions respect TP. The engine
owns gradient accumulation, DP averaging and clipping (``gradient_clipping``). CPU machines use
DeepSpeed's CPU accelerator with gloo; its shared-memory communication op is not JIT-built (it is an
optimisation for multi-process CPU training that needs a compiler and ~30 s).
"""
from __future__ import annotations

import sys

from megatron.core import parallel_state as ps


class McoreMPU:
    """DeepSpeed's mpu protocol over megatron.core.parallel_state."""

    @staticmethod
    def _ps():
        return ps

    def get_model_parallel_rank(self):
        return self._ps().get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self):
        return self._ps().get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return self._ps().get_tensor_model_parallel_group()

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    # DeepSpeed's "data parallel" group is DP x CP: the context-parallel ranks of a replica hold the same
    # weights and add up their gradients (setdiff_mega/parallel/context.py), so ZeRO partitions over them too
    def get_data_parallel_rank(self):
        return self._ps().get_data_parallel_rank(with_context_parallel=True)

    def get_data_parallel_world_size(self):
        return self._ps().get_data_parallel_world_size(with_context_parallel=True)

    def get_data_parallel_group(self):
        return self._ps().get_data_parallel_group(with_context_parallel=True)


def import_deepspeed():
    """Import DeepSpeed without JIT-building its CPU shared-memory comm op."""
    import deepspeed  # gated: imported only when ZeRO runs (its import costs seconds)

    mod = sys.modules.get("deepspeed.comm.torch")
    if mod is not None and hasattr(mod, "build_shm_op"):
        mod.build_shm_op = lambda: None
    return deepspeed


def zero_engine(model, optimizer, tc):
    """DeepSpeed engine for ``model`` with the client ``optimizer`` (a torch AdamW) and ZeRO ``tc.zero_stage``."""
    deepspeed = import_deepspeed()
    config = {
        "train_micro_batch_size_per_gpu": tc.micro_batch_size,
        "gradient_accumulation_steps": tc.grad_accum_steps,
        "gradient_clipping": tc.clip_grad if tc.clip_grad > 0 else 0.0,
        "zero_optimization": {"stage": tc.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": tc.precision == "bf16"},
        "steps_per_print": 10 ** 12,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=McoreMPU(),
                                           dist_init_required=False)
    return engine


__all__ = ["McoreMPU", "zero_engine", "import_deepspeed"]
