"""Initialise torch.distributed and megatron-core's parallel state.

One process without a launcher gets a private single-rank group, so the same model code (which needs mcore's
parallel state) runs in scripts, tests, notebooks and the server: its rendezvous is an in-process store (no TCP
store, which would listen on every interface) and gloo's pair sockets of the groups made here are bound to the
loopback interface (``GLOO_SOCKET_IFNAME`` unless set, only while they are made), so such a process exposes no
port. Launchers are
recognised from their environment (:func:`discover_launcher_env`): torchrun and the deepspeed launcher
(``RANK / WORLD_SIZE / LOCAL_RANK``), MPI (MPICH / Hydra ``PMI_RANK / PMI_SIZE / MPI_LOCALRANKID``, Open
MPI ``OMPI_COMM_WORLD_*``) and Slurm (``SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID``); ``MASTER_ADDR``
defaults to 127.0.0.1 and ``MASTER_PORT`` to 29500. Backend: gloo on CPU, nccl on GPU.
Layout: world = TP x CP x PP x DP (checked before any group is built; megatron-core's rank order
tp-cp-ep-dp-pp).
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from setdiff_mega.compat import mcore_cpu


@dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str


def _loopback() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), None if there is none."""
    names = [n for _, n in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


@contextlib.contextmanager
def _loopback_gloo(active: bool):
    """While active: gloo groups created meanwhile bind the loopback interface (``GLOO_SOCKET_IFNAME``, read at
    each group's creation), unless the user set the variable; restored afterwards, so child processes (a
    multi-node launch from this process) never inherit it."""
    name = _loopback() if active and "GLOO_SOCKET_IFNAME" not in os.environ else None
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        if name is not None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


def discover_launcher_env(env=None) -> dict | None:
    """{RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, launcher} from a launcher's variables."""
    env = os.environ if env is None else env
    found = None
    if "RANK" in env and "WORLD_SIZE" in env:
        found = ("torchrun/deepspeed", env["RANK"], env["WORLD_SIZE"], env.get("LOCAL_RANK", "0"))
    elif "OMPI_COMM_WORLD_RANK" in env:
        found = ("openmpi", env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"],
                 env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        found = ("mpich", env["PMI_RANK"], env["PMI_SIZE"], env.get("MPI_LOCALRANKID", env.get("PMI_LOCAL_RANK", "0")))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        found = ("slurm", env["SLURM_PROCID"], env["SLURM_NTASKS"], env.get("SLURM_LOCALID", "0"))
    if found is None:
        return None
    launcher, rank, world, local = found
    return {"launcher": launcher, "RANK": str(int(rank)), "WORLD_SIZE": str(int(world)),
            "LOCAL_RANK": str(int(local)), "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": env.get("MASTER_PORT", "29500")}


def initialize(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
               seed: int = 1234, backend: str | None = None,
               virtual_pipeline_model_parallel_size: int | None = None,
               context_parallel_size: int = 1) -> DistributedEnv:
    """Initialise torch.distributed (if needed), mcore parallel state and the model-parallel RNG."""
    mcore_cpu.apply()                        # megatron-core on a CPU-only torch (idempotent; no-op with CUDA)

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    single = False
    if not dist.is_initialized():
        found = discover_launcher_env()
        if found is not None and int(found["WORLD_SIZE"]) > 1:
            os.environ.update({k: v for k, v in found.items() if k != "launcher"})
        single = not ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    with _loopback_gloo(single and backend == "gloo"):
        if single:                           # rendezvous in-process: no TCP store listening on every interface
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        elif not dist.is_initialized():
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if backend == "nccl":
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend=backend)
        world = dist.get_world_size()
        tp, pp, cp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size), int(context_parallel_size)
        if world % (tp * cp * pp):
            raise ValueError(f"world size {world} is not divisible by TP*CP*PP = {tp}*{cp}*{pp} = {tp * cp * pp}")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                                         context_parallel_size=cp)
    model_parallel_cuda_manual_seed(seed)
    return DistributedEnv(rank=dist.get_rank(), world_size=world,
                          local_rank=int(os.environ.get("LOCAL_RANK", 0)), backend=backend)


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def shutdown() -> None:
    """Destroy mcore's parallel state and the process group (safe to call twice)."""
    try:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
