"""Model and optimizer state through megatron-core's distributed checkpointing (``torch_dist`` format).

Every rank contributes its own shards: ``model.sharded_state_dict()`` describes each local tensor as a
slice of a *global* tensor (TP: the partition dimension; PP: the global layer index), and the AdamW
moments ``exp_avg`` / ``exp_avg_sq`` get the sharding of their parameter
(``optimizer.state.<key>.<param key>``). Loading asks for the slices the *current* layout needs, so a
checkpoint written with one (TP, PP, DP) layout loads into any other: resharding is a property of the
format, not a conversion step.

With ``train.ema_decay`` the weights' EMA is a third part, keys ``ema.*`` sharded like the weights
(:mod:`setdiff_mega.training.ema`); ``load_sharded(..., weights="ema")`` loads it into the model.

The AdamW step counter (a scalar per parameter, equal for all of them) is stored once, in the common
(non-sharded) part, and restored as the same float32 tensor, so a resumed optimizer is bit-identical.
Before loading, the checkpoint's tensor metadata is compared with the model's global shapes, so a
different model size or vocabulary fails with the tensor's name and both shapes instead of a trace
from inside torch.distributed.checkpoint.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from multiprocessing.managers import SyncManager
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
from megatron.core.dist_checkpointing.validation import StrictHandling

from setdiff_mega.lifeline import tie_forks_to_parent, tie_to_parent

from .io import CheckpointError

EMA_PREFIX = "ema."                     # keys of the weights' EMA (setdiff_mega.training.ema)


def has_ema(path) -> bool:
    """Whether the distributed checkpoint at ``path`` holds EMA tensors."""
    return any(k.startswith(EMA_PREFIX) for k in dist_checkpointing.load_tensors_metadata(str(path)))


def _optim_params(optimizer):
    return itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter an (all-zero) AdamW state, the template a sharded load fills in."""
    for p in _optim_params(optimizer):
        if p not in optimizer.state or not optimizer.state[p]:
            optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def optimizer_sharded_state_dict(optimizer: torch.optim.Optimizer, model_ssd: dict) -> dict:
    """The optimizer's state dict with every per-parameter tensor sharded like its parameter."""
    osd = optimizer.state_dict()
    steps = {float(s["step"]) for s in osd["state"].values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"the optimizer's parameters are at different steps {sorted(steps)[:4]}; "
                              f"cannot store one step counter")
    id_map = get_param_id_to_sharded_param_map(model_ssd, _optim_params(optimizer))
    optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
    osd["adam_step"] = steps.pop() if steps else 0.0
    return osd


def _tensor_shapes(ssd) -> dict:
    """key -> global shape of every ShardedTensor in ``ssd`` (factories, e.g. SwiGLU's split fc1 under TP,
    are built to see the tensors they will write)."""
    out = {}
    stack = [ssd]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, ShardedTensorFactory):
            stack.append(v.build())
        elif isinstance(v, ShardedTensor):
            out[v.key] = tuple(v.global_shape)
    return out


def check_compatible(ssd: dict, path: Path, what: str = "model", complete: bool = True, prefix: str = "") -> None:
    """Raise a CheckpointError naming the tensor when the checkpoint at ``path`` cannot fill ``ssd``
    or (``complete``: ``ssd`` is a whole model, not one pipeline stage) holds weights it would ignore.
    ``prefix``: the keys ``ssd`` asks for (``ema.``: the weights' EMA); other prefixes are not weights."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"'{path}' is not a complete distributed checkpoint (no '.metadata' file)")
    try:
        saved = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(str(path)).items()}
    except Exception as e:
        raise CheckpointError(f"'{path / '.metadata'}' is unreadable ({type(e).__name__}: {e})") from None
    wanted = _tensor_shapes(ssd)
    if prefix and not any(k.startswith(prefix) for k in saved):
        raise CheckpointError(f"'{path}' holds no EMA weights (train.ema_decay was 0 when it was saved); "
                              f"load its raw weights (--weights raw)")
    for key, shape in sorted(wanted.items()):
        if key not in saved:
            raise CheckpointError(f"'{path}' has no tensor '{key}' that this {what} needs: the checkpoint is of a "
                                  f"different architecture (layers, normalization, activation or bias settings)")
        if saved[key] != shape:
            vocab_axis = key[len(prefix):].startswith(("embedding.word_embeddings", "output_layer"))
            hint = (" (the vocabulary differs: rebuild with the checkpoint's tokenizer / model.vocab_size)"
                    if vocab_axis and saved[key][0] != shape[0] else
                    " (a different model size: layers, hidden size, heads or FFN width)")
            raise CheckpointError(f"'{path}': tensor '{key}' has global shape {saved[key]}, this {what} expects "
                                  f"{shape}{hint}")
    unused = sorted(k for k in saved if k.startswith(prefix) and not k.startswith("optimizer.") and k not in wanted
                    and (prefix or not k.startswith(EMA_PREFIX)))
    if complete and unused:
        raise CheckpointError(f"'{path}' has weights this {what} does not have ({', '.join(unused[:3])}"
                              f"{' ...' if len(unused) > 3 else ''}): the checkpoint is of a different architecture")


def start_writer_service() -> None:
    """Start megatron-core's checkpoint-writer helper process now, immune to SIGTERM / SIGUSR1 and tied
    to the trainer's life.

    ``dist_checkpointing.save`` collects its writers' results through a multiprocessing manager process
    (megatron-core spawns it on first use and keeps it). Spawned as megatron-core does it, that helper
    would die with the SIGTERM that asks the trainer to save (``scancel``, ``kill`` of the job's
    processes), and the save it was meant to allow would fail; and nothing would stop it (and the
    resource tracker that shares its pipe) when the trainer is SIGKILLed. So the manager is started here,
    before training, with an initializer (:func:`setdiff_mega.lifeline.tie_to_parent`) that ignores the
    two signals, asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``) and polls the
    parent as a fallback; its queue is handed to megatron-core. The resource tracker that multiprocessing
    starts beside it exits by itself once every holder of its pipe is gone. The writer processes that
    megatron-core forks for each save are tied the same way (:func:`setdiff_mega.lifeline.tie_forks_to_parent`):
    one caught mid-save by a SIGKILL would otherwise block at exit on a queue nobody reads, and hold
    the tracker's pipe open. Also moves the ~2 s start-up out of the first save.
    Tied to megatron-core 0.16.1's ``filesystem_async._results_queue``; a no-op when that moves.
    """
    tie_forks_to_parent()
    if not hasattr(fa, "_results_queue") or fa._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=tie_to_parent, initargs=(os.getpid(),))
    fa._results_queue = manager.Queue()               # the proxy keeps the manager alive


def save_sharded(path: Path, model, optimizer: torch.optim.Optimizer | None = None, ema=None,
                 asynchronous: bool = False):
    """Collective: write ``model`` (and ``optimizer``, and the weights' EMA) shards of every rank into ``path``.
    ``asynchronous``: return megatron-core's AsyncRequest instead (nothing written yet; scheduled on an
    ``AsyncCallsQueue``, its writer process forks with a snapshot of the tensors, so training may go on)."""
    path.mkdir(parents=True, exist_ok=True)
    ssd = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        ssd["optimizer"] = optimizer_sharded_state_dict(optimizer, ssd["model"])
    if ema is not None:
        ssd["ema"] = ema.sharded_state_dict()[0]
    return dist_checkpointing.save(ssd, str(path), async_sharded_save=asynchronous)


def save_releasing(path: Path, model) -> None:
    """Collective: :func:`save_sharded` of the weights of a model that is discarded afterwards (an import),
    holding them once. megatron-core's writer clones every tensor that is a view of a larger storage, all
    of them before it writes (``filesystem_async._clone_if_needed``), and its SwiGLU factory hands it each
    ``linear_fc1`` as gate / up views: a second copy of every MLP input matrix. Here the factories are
    built first, the views of one parameter cloned, then that parameter's storage released, one
    parameter at a time. The model's weights are gone afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    ssd = {"model": model.sharded_state_dict()}
    apply_factories(ssd)
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    views: dict = {}
    for sh in nested_values(ssd):
        t = sh.data if isinstance(sh, ShardedTensor) else None
        if t is not None and t.untyped_storage().nbytes() != t.numel() * t.element_size():
            views.setdefault(t.untyped_storage().data_ptr(), []).append(sh)
    for ptr, shards in views.items():
        for sh in shards:
            sh.data = sh.data.clone()
        if ptr in params:
            params[ptr].data = torch.empty(0, dtype=params[ptr].dtype)
    dist_checkpointing.save(ssd, str(path))


def load_sharded(path: Path, model, optimizer: torch.optim.Optimizer | None = None, weights: str = "raw") -> None:
    """Collective: fill this rank's shards of ``model`` (and ``optimizer``) from ``path``; ``weights="ema"``
    loads the checkpoint's EMA into the model instead of its raw weights."""
    if weights == "ema" and optimizer is not None:
        raise ValueError("the optimizer state belongs to the raw weights: load it with weights='raw'")
    prefix = EMA_PREFIX if weights == "ema" else ""
    model_ssd = model.sharded_state_dict(prefix=prefix)
    check_compatible(model_ssd, path, complete=bool(model.pre_process and model.post_process), prefix=prefix)
    request = {"model": model_ssd}
    if optimizer is not None:
        init_optimizer_state(optimizer)
        request["optimizer"] = optimizer_sharded_state_dict(optimizer, model_ssd)
    try:
        loaded = dist_checkpointing.load(request, str(path), strict=StrictHandling.LOG_UNEXPECTED)
    except CheckpointError:
        raise
    except Exception as e:
        what = "model and optimizer" if optimizer is not None else "model"
        raise CheckpointError(f"could not read the {what} from '{path}' ({type(e).__name__}: {e}); a shard file "
                              f"is missing or truncated; use an earlier checkpoint") from None
    model.load_sharded_state(_strip(loaded["model"], prefix) if prefix else loaded["model"])
    if optimizer is not None:
        osd = loaded["optimizer"]
        step = torch.tensor(float(osd.pop("adam_step")))
        for st in osd["state"].values():
            st["step"] = step.clone()
        optimizer.load_state_dict(osd)


def _strip(tree: dict, prefix: str) -> dict:
    """State-dict keys without ``prefix`` (nested dicts: ModelChunks' ``chunk<i>`` levels)."""
    out = {}
    for k, v in tree.items():
        if isinstance(k, str) and k.startswith(prefix):
            out[k[len(prefix):]] = v
        else:
            out[k] = _strip(v, prefix) if isinstance(v, dict) else v
    return out


def load_ema(path: Path, ema) -> None:
    """Collective: fill the training EMA (:class:`setdiff_mega.training.ema.EMA`) from ``path``."""
    ssd, leaves = ema.sharded_state_dict()
    check_compatible(ssd, path, "EMA", complete=False, prefix=EMA_PREFIX)
    try:
        loaded = dist_checkpointing.load({"ema": ssd}, str(path), strict=StrictHandling.LOG_UNEXPECTED)
    except Exception as e:
        raise CheckpointError(f"could not read the EMA from '{path}' ({type(e).__name__}: {e}); a shard file is "
                              f"missing or truncated; use an earlier checkpoint") from None
    ema.load(loaded["ema"], leaves, ssd)


__all__ = ["save_sharded", "save_releasing", "load_sharded", "load_ema", "has_ema", "EMA_PREFIX",
           "start_writer_service", "check_compatible",
           "init_optimizer_state",
           "optimizer_sharded_state_dict"]
