"""Training checkpoints: save (every N steps, at the end, on a stop signal), resume exactly.

What a training checkpoint holds (directory layout and publication protocol: :mod:`.io`):

* weights (+ AdamW moments when the project optimizer is used) as megatron-core distributed-checkpoint
  shards of every rank (``dist/``), loadable into any (TP, PP, DP) layout;
* with DeepSpeed ZeRO, the engine's own optimizer / gradient-partition shards (``zero/``, DeepSpeed's
  checkpoint API; they need the same DP size to load) next to the portable weights in ``dist/``;
* with ``train.ema_decay``, the weights' EMA next to the weights in ``dist/`` (keys ``ema.*``, any layout);
* every rank's RNG states (torch CPU / CUDA, megatron-core's model-parallel tracker, python, numpy);
* ``state.json``: step, consumed samples (the data position: sample ``i`` and its noise depend only on
  ``i`` and the seeds), the parallel layout, the last validation loss.

The optimizer's part is the optimizer backend's (:mod:`setdiff_mega.training.updates`: AdamW + DDP, or a
ZeRO engine), handed in as one object with ``kind``, ``save`` and ``load``; this module decides when and
where, and publishes. Resume is exact because everything the next step depends on is restored:
parameters and optimizer moments bit for bit, the AdamW step counter, the learning rate (a pure function
of the step), the data stream (restarted at ``consumed_samples``), per-sample noise (a function of the
sample index), RNGs. Which checkpoint a run continues, and the run directory's lock, are
:mod:`.rundir`'s.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from setdiff_mega import methods

from .io import CheckpointError
from .native import check_model_config, checkpoint_config, staged_save
from .sharded import has_ema, load_ema, load_sharded, start_writer_service

FAULT_ENV = "SETDIFF_MEGA_FAULT"     # "kill_in_save:<step>": the job dies by SIGKILL inside that save (tests)


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _die() -> None:
    """SIGKILL this rank and its helper processes (what a node failure or ``kill -9`` of the job does)."""
    for child in multiprocessing.active_children():
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "mcore_tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["mcore_tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def check_resumable(found: tuple[Path, dict], cfg) -> None:
    """The checkpoint continues this run: same architecture, the method's identity fields, the same
    length, and a training (not weights-only) checkpoint; else one CheckpointError naming the field."""
    ck, state = found
    saved = checkpoint_config(ck)
    check_model_config(saved.model, cfg.model, f"checkpoint '{ck}'")
    identity = [("objective", "name"), *(("objective", f) for f in methods.get(saved.objective.name).run_fields),
                ("data", "seq_length")]                 # the method's options name their fields
    for section, name in identity:
        a, b = getattr(getattr(saved, section), name), getattr(getattr(cfg, section), name)
        if a != b:
            raise CheckpointError(f"checkpoint '{ck}' (train.resume={cfg.train.resume}) was trained with "
                                  f"{section}.{name}={a!r}, this run has {b!r}: to continue it keep {a!r}; for a "
                                  f"new run use another train.save_dir (or replace this run: train.resume=none "
                                  f"train.overwrite=true), and train.init_from={ck} to start from its weights")
    if state.get("kind") != "training":
        raise CheckpointError(f"'{ck}' is a weights-only checkpoint (no optimizer or data position); "
                              f"start from it with train.init_from={ck} instead of train.resume")


def load_resume_weights(found: tuple[Path, dict], model, cfg) -> None:
    """Before the optimizer / engine exist (ZeRO partitions the loaded weights): check, then load the
    weights of any layout."""
    check_resumable(found, cfg)
    load_sharded(found[0] / "dist", model)


class Checkpointer:
    """Saves and restores the complete training state of one run (every rank calls every method); built
    once every stateful part exists (model, optimizer backend, EMA)."""

    def __init__(self, cfg, tokenizer, model, backend, log=print, ema=None):
        self.cfg, self.tok, self.model, self.backend = cfg, tokenizer, model, backend
        self.log, self.ema = log, ema
        self.save_dir = Path(cfg.train.save_dir)
        start_writer_service()
        self.async_queue = None
        if cfg.train.async_save:
            self.async_queue = AsyncCallsQueue()      # one forked writer per save: a snapshot of the tensors
        self._in_flight: dict = {}                    # async call index -> (step, checkpoint path)

    def poll(self, step: int) -> None:
        """After training ``step``: publish the asynchronous saves whose writers are done on every rank
        (collective; one small all-reduce while a save is in flight)."""
        if self.async_queue is not None and self.async_queue.get_num_unfinalized_calls():
            self._published(self.async_queue.maybe_finalize_async_calls(blocking=False), step)

    def wait(self, step: int | None = None) -> None:
        """Block until every scheduled save is written and published (collective)."""
        if self.async_queue is not None:
            self._published(self.async_queue.maybe_finalize_async_calls(blocking=True), step)

    def _published(self, calls: list, step: int | None) -> None:
        for idx in calls:
            saved, path = self._in_flight.pop(idx)
            later = "" if step is None else f", {step - saved} training step(s) after it was scheduled"
            self.log(f"published {path} (written asynchronously{later})")

    def due(self, step: int) -> bool:
        """A periodic save after ``step`` (``train.save_interval``; the last step always saves in _finish)."""
        tc = self.cfg.train
        return tc.save_interval > 0 and step % tc.save_interval == 0 and step != tc.train_steps

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, consumed: int, metrics: dict) -> Path:
        rank, _ = _world()

        def write_shards(tmp: Path):
            (tmp / "rng").mkdir(exist_ok=True)
            torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
            request = self.backend.save(tmp, self.ema, asynchronous=self.async_queue is not None)
            if os.environ.get(FAULT_ENV, "") == f"kill_in_save:{step}":
                if request is not None:                  # a writer in flight: let it start, then crash
                    self.async_queue.schedule_async_request(request)
                _die()                               # simulated crash: shards written, never published
            return request

        tc = self.cfg.train
        state = {"kind": "training", "consumed_samples": consumed, **metrics, "optimizer": self.backend.kind,
                 "zero_stage": tc.zero_stage, "seed": tc.seed,
                 "global_batch_samples": tc.global_batch(ps.get_data_parallel_world_size())}
        self.wait(step)                                  # one save in flight at a time
        path = staged_save(self.save_dir, step, write_shards, self.cfg, self.tok, state, tc.keep_last,
                           self.async_queue)
        if self.async_queue is not None:
            self._in_flight[self.async_queue.call_idx] = (step, path)
        return path

    # -- resuming (the weights were loaded by load_resume_weights before the optimizer existed) ------
    def load_training_state(self, found: tuple[Path, dict]) -> dict:
        """After the optimizer backend exists: its state, the EMA, the RNGs; returns the checkpoint's state
        (step, consumed samples, metrics)."""
        ck, state = found
        rank, world = _world()
        if self.cfg.train.resume_optimizer:
            saved_kind = state.get("optimizer")
            if saved_kind != self.backend.kind:
                raise CheckpointError(f"'{ck}' holds a {saved_kind} optimizer state, this run uses "
                                      f"{self.backend.kind}; keep train.zero_stage={state.get('zero_stage')} or "
                                      f"set train.resume_optimizer=false to resume the weights only")
            self.backend.load(ck, state)
        self._load_ema(ck)
        rng_file = ck / "rng" / f"rank_{rank:05d}.pt"
        if state.get("world_size") == world and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            self.log(f"note: '{ck}' was saved with {state.get('world_size')} ranks, this run has {world}: RNG "
                     f"states start fresh (data order and noise are unaffected)")
        if state.get("global_batch_samples") not in (None, self.cfg.train.global_batch(
                ps.get_data_parallel_world_size())):
            self.log(f"note: the global batch changed ({state['global_batch_samples']} samples per step when "
                     f"saved); training continues at sample {state['consumed_samples']}")
        return state

    def _load_ema(self, ck: Path) -> None:
        if self.ema is None:
            return
        if has_ema(ck / "dist"):
            load_ema(ck / "dist", self.ema)
        else:
            self.log(f"note: '{ck}' holds no EMA (saved with train.ema_decay=0): the EMA starts from the "
                     f"resumed weights")


__all__ = ["Checkpointer", "check_resumable", "load_resume_weights", "rng_state", "set_rng_state", "FAULT_ENV"]
