"""Training checkpoints: save (every N steps, at the end, on SIGTERM / SIGUSR1), resume exactly.

What a training checkpoint holds (directory layout and publication protocol: :mod:`setdiff_mega.checkpoint.io`):

* weights (+ AdamW moments when the project optimizer is used) as megatron-core distributed-checkpoint
  shards of every rank (``dist/``), loadable into any (TP, PP, DP) layout;
* with DeepSpeed ZeRO, the engine's own optimizer / gradient-partition shards (``zero/``, DeepSpeed's
  checkpoint API; they need the same DP size to load) next to the portable weights in ``dist/``;
* with ``train.ema_decay``, the weights' EMA next to the weights in ``dist/`` (keys ``ema.*``, any layout);
* every rank's RNG states (torch CPU / CUDA, megatron-core's model-parallel tracker, python, numpy);
* ``state.json``: step, consumed samples (the data position: sample ``i`` and its noise depend only on
  ``i`` and the seeds), the parallel layout, the last validation loss.

Resume is exact because everything the next step depends on is restored: parameters and optimizer
moments bit for bit, the AdamW step counter, the learning rate (a pure function of the step), the data
stream (restarted at ``consumed_samples``), per-sample noise (a function of the sample index), RNGs.

Signals: SIGTERM (what schedulers send before a kill), SIGUSR1 (Slurm's ``--signal``) and SIGINT (Ctrl-C;
a second Ctrl-C aborts at once, without saving) set a flag; at the end of the current step all ranks
agree (an all-reduce, since a signal may reach only some ranks), save, and leave the loop cleanly.
"""
from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from setdiff_mega import methods
from setdiff_mega.checkpoint.io import CheckpointError
from setdiff_mega.checkpoint.native import check_model_config, checkpoint_config, staged_save
from setdiff_mega.checkpoint.rundir import find_resume
from setdiff_mega.checkpoint.sharded import load_ema, load_sharded, save_sharded, start_writer_service

FAULT_ENV = "SETDIFF_MEGA_FAULT"     # "kill_in_save:<step>": the job dies by SIGKILL inside that save (tests)


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _die() -> None:
    """SIGKILL this rank and its helper processes (what a node failure or ``kill -9`` of the job does)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "mcore_tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["mcore_tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ExitSignals:
    """SIGTERM / SIGUSR1 / SIGINT -> a flag checked (and agreed on by all ranks) at step boundaries; a second
    SIGINT raises KeyboardInterrupt (abort now, no save)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.received: int | None = None
        self.interrupted = False
        self._previous = {}

    def __enter__(self):
        if self.enabled:
            try:
                for s in self.SIGNALS:
                    self._previous[s] = signal.signal(s, self._handler)
            except ValueError:           # not the main thread: leave signal handling to the caller
                self.enabled = False
        return self

    def _handler(self, signum, frame):
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
            print("\nSIGINT: saving at the end of this step, then stopping (Ctrl-C again aborts without saving)",
                  file=sys.stderr, flush=True)
        self.received = signum

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def agreed(self) -> str | None:
        """Name of the signal if any rank received one (collective when there are several ranks)."""
        if not self.enabled:
            return None
        flag = torch.tensor([float(self.received or 0)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else None


def check_resumable(found: tuple[Path, dict], cfg) -> None:
    """The checkpoint continues this run: same architecture, the method's identity fields, the same
    length, and a training (not weights-only) checkpoint; else one CheckpointError naming the field."""
    ck, state = found
    saved = checkpoint_config(ck)
    check_model_config(saved.model, cfg.model, f"checkpoint '{ck}'")
    identity = [("objective", "name"), *(("objective", f) for f in methods.get(saved.objective.name).run_fields),
                ("data", "seq_length")]                 # the method's record names its fields
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
    once every stateful part exists (model, optimizer or ZeRO engine, EMA)."""

    def __init__(self, cfg, tokenizer, model, optimizer, engine=None, log=print, ema=None):
        self.cfg, self.tok, self.model, self.optimizer, self.engine = cfg, tokenizer, model, optimizer, engine
        self.log, self.ema = log, ema
        self.save_dir = Path(cfg.train.save_dir)
        self.zero = cfg.train.zero_stage
        start_writer_service()
        self.async_queue = None
        if cfg.train.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

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

    @property
    def optimizer_kind(self) -> str:
        return f"deepspeed_zero{self.zero}" if self.engine is not None else "adamw"

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, consumed: int, metrics: dict) -> Path:
        from megatron.core import parallel_state as ps

        rank, _ = _world()

        def write_shards(tmp: Path):
            (tmp / "rng").mkdir(exist_ok=True)
            torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
            request = None
            if self.engine is None:
                request = save_sharded(tmp / "dist", self.model, self.optimizer, self.ema,
                                       asynchronous=self.async_queue is not None)
            else:
                self._save_zero(tmp)
            if os.environ.get(FAULT_ENV, "") == f"kill_in_save:{step}":
                if request is not None:                  # a writer in flight: let it start, then crash
                    self.async_queue.schedule_async_request(request)
                _die()                               # simulated crash: shards written, never published
            return request

        tc = self.cfg.train
        state = {"kind": "training", "consumed_samples": consumed, **metrics, "optimizer": self.optimizer_kind,
                 "zero_stage": self.zero, "seed": tc.seed,
                 "global_batch_samples": tc.global_batch(ps.get_data_parallel_world_size())}
        self.wait(step)                                  # one save in flight at a time
        path = staged_save(self.save_dir, step, write_shards, self.cfg, self.tok, state, tc.keep_last,
                           self.async_queue)
        if self.async_queue is not None:
            self._in_flight[self.async_queue.call_idx] = (step, path)
        return path

    def _save_zero(self, tmp: Path) -> None:
        from setdiff_mega.parallel.zero import import_deepspeed

        if self.zero == 3:         # parameters are partitioned: gather them for the portable copy
            with import_deepspeed().zero.GatheredParameters(list(self.model.parameters())):
                save_sharded(tmp / "dist", self.model, ema=self.ema)
        else:
            save_sharded(tmp / "dist", self.model, ema=self.ema)
        self.engine.save_checkpoint(str(tmp / "zero"), tag="state", save_latest=False)

    # -- resuming (the weights were loaded by load_resume_weights before the optimizer existed) ------
    def load_training_state(self, found: tuple[Path, dict]) -> dict:
        """After the optimizer / engine exist: optimizer, RNG; returns step, consumed samples, metrics."""
        from megatron.core import parallel_state as ps

        ck, state = found
        rank, world = _world()
        saved_kind = state.get("optimizer")
        if self.cfg.train.resume_optimizer:
            if saved_kind != self.optimizer_kind:
                raise CheckpointError(f"'{ck}' holds a {saved_kind} optimizer state, this run uses "
                                      f"{self.optimizer_kind}; keep train.zero_stage={state.get('zero_stage')} or "
                                      f"set train.resume_optimizer=false to resume the weights only")
            if self.engine is None:
                load_sharded(ck / "dist", self.model, self.optimizer)
            else:
                parts = ps.get_data_parallel_world_size(with_context_parallel=True)     # DP x CP
                saved = state.get("zero_partitions", state.get("data_parallel_size"))
                if saved != parts:
                    raise CheckpointError(f"'{ck / 'zero'}' holds ZeRO shards for DP x CP = {saved}, this run has "
                                          f"DP x CP = {parts}; use the same world size / TP / CP / PP, or set "
                                          f"train.resume_optimizer=false to resume the weights only")
                path, _ = self.engine.load_checkpoint(str(ck / "zero"), tag="state", load_optimizer_states=True,
                                                      load_lr_scheduler_states=False, load_module_strict=True)
                if path is None:
                    raise CheckpointError(f"DeepSpeed could not load '{ck / 'zero'}' (missing or truncated shards)")
        if self.ema is not None:
            from .ema import has_ema

            if has_ema(ck / "dist"):
                load_ema(ck / "dist", self.ema)
            else:
                self.log(f"note: '{ck}' holds no EMA (saved with train.ema_decay=0): the EMA starts from the "
                         f"resumed weights")
        rng_file = ck / "rng" / f"rank_{rank:05d}.pt"
        if state.get("world_size") == world and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            self.log(f"note: '{ck}' was saved with {state.get('world_size')} ranks, this run has {world}: RNG "
                     f"states start fresh (data order and noise are unaffected)")
        if state.get("global_batch_samples") not in (None, self.cfg.train.micro_batch_size
                                                     * self.cfg.train.grad_accum_steps
                                                     * ps.get_data_parallel_world_size()):
            self.log(f"note: the global batch changed ({state['global_batch_samples']} samples per step when "
                     f"saved); training continues at sample {state['consumed_samples']}")
        return state


__all__ = ["Checkpointer", "ExitSignals", "find_resume", "check_resumable", "load_resume_weights", "rng_state",
           "set_rng_state", "FAULT_ENV"]
