"""Fork-based multi-rank launcher on one machine (gloo on loopback), for the tests and local benchmarks.

``run_ranks(fn, world, args)`` runs ``fn(rank, world, *args)`` in ``world`` processes with torch.distributed
initialised (gloo, loopback) and returns {rank: result}. Forked children inherit the already imported
megatron-core (importing it costs ~6 s per process), so a 2-rank run costs about a second. Forking a
process that already holds a gloo process group crashes the children, so when the caller has one
(another test initialised megatron's parallel state first) the launcher spawns fresh interpreters
instead: slower, same results.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback

# megatron-core imported once, in the parent, so that forked ranks inherit it (~6 s per process otherwise)
import megatron.core.dist_checkpointing  # noqa: F401
import megatron.core.distributed  # noqa: F401
import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
import megatron.core.transformer.transformer_block  # noqa: F401
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_mega.compat import mcore_cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, fn, args, queue):
    try:

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # results travel as bytes: tensors put on a queue are shared through file descriptors that the
        # exiting child may no longer serve (intermittent FileNotFoundError in the parent)
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:

            ps.destroy_model_parallel()
            dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn, world: int = 2, args: tuple = (), timeout: float = 240.0) -> dict:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; returns {rank: result}."""
    mcore_cpu.apply()                          # the launcher is an entry point: the ranks inherit the shim
    ctx = mp.get_context("spawn" if dist.is_initialized() else "fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in procs:
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return results


__all__ = ["run_ranks"]
