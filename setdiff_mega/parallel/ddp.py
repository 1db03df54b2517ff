"""Data-parallel gradient reduction for every non-ZeRO layout: megatron-core's ``DistributedDataParallel``.

Every model chunk this rank runs (the model itself, its pipeline stage, or its V virtual-stage chunks) is
wrapped in megatron-core's DDP over the data-parallel-with-context-parallel group (DP x CP ranks: the
CP ranks of a replica add up their gradients, see :mod:`setdiff_mega.parallel.context`). Gradients
accumulate into one contiguous ``param.main_grad`` buffer per chunk, cut into buckets of
``parallel.ddp_bucket_size`` elements; with ``parallel.overlap_grad_reduce`` each bucket's all-reduce
(pre-scaled by 1 / (DP x CP), i.e. the mean) starts asynchronously as soon as the last micro-batch's
backward has produced all of its gradients, overlapping with the rest of the backward:

* PP = 1: the first n - 1 micro-batches run under :meth:`GradReducer.no_sync`; the last one launches the
  buckets as they fill.
* PP > 1: megatron-core's 1F1B / interleaved schedule drives the same switch through the model config's
  ``no_sync_func`` (and ``grad_sync_func`` per chunk for the interleaved schedule), so the buckets of a
  stage reduce during its cooldown backwards instead of one flat all-reduce after the schedule.

:meth:`GradReducer.finish` waits for the outstanding buckets and points every ``param.grad`` at its
``main_grad`` slice, so clipping, the non-finite guard and the torch optimizer see ordinary gradients.
The weights are broadcast from the first DP x CP rank at wrap time (what torch DDP does).
"""
from __future__ import annotations

import contextlib
import time

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from setdiff_mega.compat import mcore_cpu


class GradReducer:
    """megatron-core DDP around every model chunk of this rank (see the module docstring)."""

    def __init__(self, model, *, overlap: bool = True, bucket_size: int = 0):
        self.model = model
        chunks = list(getattr(model, "chunks", [model]))      # the V chunks of interleaved stages, or the model
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=bucket_size or None)
        with mcore_cpu.cuda_redirect():
            self.chunks = [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]
            for c in self.chunks:
                c.broadcast_params()
        config = chunks[0].config                    # what megatron-core's schedules read
        no_sync = [c.no_sync for c in self.chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if overlap and len(self.chunks) > 1:
            config.grad_sync_func = [c.start_grad_sync for c in self.chunks]
        self.overlap = overlap
        self.waited = 0.0                            # seconds spent in finish(): the straggler report's wait

    @property
    def num_buckets(self) -> int:
        return sum(len(c.bucket_groups) for c in self.chunks)

    def __call__(self, *args, **kwargs):
        """PP = 1: the forward of the wrapped model."""
        return self.chunks[0](*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate without reducing (every micro-batch but the last)."""
        with contextlib.ExitStack() as stack:
            for c in self.chunks:
                stack.enter_context(c.no_sync())
            yield

    def zero(self) -> None:
        """Zero the gradient buffers and drop the ``.grad`` views of them (start of every step: a view left
        in ``.grad`` would be accumulated into by autograd and then added to its own buffer again)."""
        for c in self.chunks:
            for p in c.module.parameters():
                p.grad = None
            c.zero_grad_buffer()

    def finish(self) -> None:
        """Wait for (or, without overlap, run) the buckets' all-reduces; ``param.grad`` = the mean gradient."""
        t0 = time.perf_counter()
        with mcore_cpu.cuda_redirect():
            for c in self.chunks:
                c.finish_grad_sync()
        self.waited += time.perf_counter() - t0
        for c in self.chunks:
            for p in c.module.parameters():
                if p.requires_grad:
                    p.grad = p.main_grad


__all__ = ["GradReducer"]
