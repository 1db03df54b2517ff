"""Initialise torch.distributed and megatron-core's parallel state.

One process without a launcher gets a private single-rank gloo group on a free loopback port, so the
same model code (which needs mcore's parallel state) runs in scripts, tests and notebooks. Under
torchrun the usual ``RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT`` are read. Backend:
gloo on CPU, nccl on GPU. Layout: world = TP x PP x DP (checked before any group is built).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
               seed: int = 1234, backend: str | None = None) -> DistributedEnv:
    """Initialise torch.distributed (if needed), mcore parallel state and the model-parallel RNG."""
    from setdiff_mega.model import mcore_cpu

    mcore_cpu.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if backend == "nccl":
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
    world = dist.get_world_size()
    tp, pp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size)
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by TP*PP = {tp}*{pp} = {tp * pp}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)
    return DistributedEnv(rank=dist.get_rank(), world_size=world,
                          local_rank=int(os.environ.get("LOCAL_RANK", 0)), backend=backend)


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def shutdown() -> None:
    """Destroy mcore's parallel state and the process group (safe to call twice)."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
