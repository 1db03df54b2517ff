"""Which blocking collective a rank is inside, for the watchdog (:mod:`.heartbeat`'s ``inside`` and
``collectives`` fields).

:func:`tracked` wraps the blocking collectives of ``torch.distributed`` (the module attributes that
megatron-core, DeepSpeed and this project call at run time) for as long as the context is open, and
restores them after: a call with ``async_op=True`` only launches the work and is passed through untouched
(its wait is what blocks: the data-parallel reducer's is wrapped by :func:`tracked_method`). The cost is two
``struct.pack_into`` per collective. Not seen: a library that bound a collective's function at import time,
and the point-to-point requests of pipeline parallelism (waited on through their request objects), so
under PP the rank named may be the hung rank's pipeline neighbour.
"""
from __future__ import annotations

import contextlib
import functools

import torch.distributed as dist

BLOCKING = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
            "_reduce_scatter_base", "_all_gather_base", "broadcast", "barrier", "monitored_barrier", "reduce",
            "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "all_gather_object",
            "broadcast_object_list", "gather_object", "scatter_object_list")


def tracked_method(heart, fn, name: str):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if kwargs.get("async_op"):
            return fn(*args, **kwargs)
        with heart.collective(name):
            return fn(*args, **kwargs)
    call.__wrapped_collective__ = fn
    return call


@contextlib.contextmanager
def tracked(heart):
    originals = {n: getattr(dist, n) for n in BLOCKING if hasattr(dist, n)}
    for n, fn in originals.items():
        setattr(dist, n, tracked_method(heart, fn, n))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


__all__ = ["tracked", "tracked_method", "BLOCKING"]
