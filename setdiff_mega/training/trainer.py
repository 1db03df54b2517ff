"""The training loop (:class:`Trainer`: ``setup`` / ``train_step`` / ``validate`` / ``save`` / ``run``):
config -> data -> model + objective -> optimizer -> checkpoint.

Runs on one process or data-parallel under torchrun (``launch.sh``): each of the D ranks reads its own
slice of every global batch (``micro_batch_size * grad_accum_steps * D`` samples per optimizer step),
draws its own noise, and torch DDP averages gradients over the group. Rank 0 logs and writes
checkpoints; a non-finite loss on any rank stops every rank or skips the step on every rank
(``train.nonfinite``, :mod:`.guard`). One optimizer step =
``grad_accum_steps`` micro-batches of ``micro_batch_size`` L-token samples per rank:

    for each micro-batch:  inputs = objective.build_inputs(tokens, generator)      # [B, T] etc.
                           logits = model(**inputs.model_kwargs())          # [B, N, V]
                           (tokens, position_ids, attention_mask + its pattern, logits_start)
                           loss   = objective.loss(logits, inputs) / grad_accum_steps; backward
    clip grad norm -> NaN/Inf check (stops with a message, no update applied) -> AdamW step

Throughput is reported both as sample tokens/s (L per sample) and processed tokens/s (the model
processes 2L tokens per sample for SetDLM and BD3LM), plus model TFLOP/s per device and, on a GPU with
a known (or configured, ``train.peak_tflops``) bf16 peak, MFU (:mod:`.flops`). Validation uses a fixed
noise generator and a fixed set of batches, so validation losses at different steps are comparable.
``precision=bf16`` runs the forward under CPU/GPU autocast with fp32 master weights. Saving, exact
resume (``train.resume=auto``) are :mod:`setdiff_mega.checkpoint.manager`'s, the stop signals :mod:`.signals`';
every step, validation and save beats the rank's heartbeat for its watchdog (:mod:`setdiff_mega.resilience`).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_mega import backends, methods
from setdiff_mega.build import model_for
from setdiff_mega.build import objective_for as objective_from_config
from setdiff_mega.build import tokenizer_for as resolve_tokenizer
from setdiff_mega.build import vocab_for as resolve_vocab
from setdiff_mega.checkpoint import adopt_architecture, load_weights
from setdiff_mega.checkpoint.hf_init import resolve_init
from setdiff_mega.checkpoint.manager import Checkpointer, load_resume_weights
from setdiff_mega.checkpoint.rundir import claim
from setdiff_mega.config import ConfigError, RunConfig, to_dict, validate_layout
from setdiff_mega.data.batch import batches
from setdiff_mega.data.indexed import DataWatch, check_dataset, check_matches
from setdiff_mega.data.loader import build_splits, parse_blend, wrap_ids
from setdiff_mega.diffusion import inputs_for
from setdiff_mega.model import padded_vocab_size
from setdiff_mega.model.token_rows import mean_token_rows
from setdiff_mega.model.transformer import model_chunks
from setdiff_mega.parallel import initialize
from setdiff_mega.resilience.runtime import FaultTolerance

from . import optim
from .ema import EMA
from .flops import flops_per_sample, peak_flops
from .guard import StepGuard, TrainingError
from .loggers import MetricLogger, peak_memory_bytes, plot_loss_curve
from .memory import check_memory
from .signals import ExitSignals
from .step import autocast_context, evaluate, mean_over_dp, step_epoch, total_parameters
from .updates import optimizer_backend


@dataclass
class TrainResult:
    final_step: int
    initial_val_loss: float
    final_val_loss: float
    checkpoint: str
    history: list
    sample_tokens_per_s: float
    processed_tokens_per_s: float
    num_parameters: int
    stopped_by: str | None = None        # the signal that stopped the run early (after saving), if any
    final_val_loss_ema: float | None = None   # with train.ema_decay: the validation loss of the EMA weights

    def summary(self) -> dict:
        """What ``<save_dir>/summary.json`` holds (and the training CLI prints)."""
        out = {"final_step": self.final_step, "initial_val_loss": round(self.initial_val_loss, 4),
               "final_val_loss": round(self.final_val_loss, 4), "checkpoint": self.checkpoint,
               "sample_tokens_per_s": round(self.sample_tokens_per_s, 1),
               "processed_tokens_per_s": round(self.processed_tokens_per_s, 1),
               "num_parameters": self.num_parameters, "stopped_by": self.stopped_by}
        if self.final_val_loss_ema is not None:
            out["final_val_loss_ema"] = round(self.final_val_loss_ema, 4)
        return out


def _memory_metrics() -> dict:
    """Peak memory (GiB) of rank 0 and the largest over all ranks (a collective: every rank calls it)."""
    own = peak_memory_bytes()
    top = torch.tensor([float(own)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    key = "cuda_max_allocated" if torch.cuda.is_available() else "peak_rss"
    return {f"mem/{key}_gib": own / 2 ** 30, f"mem/{key}_gib_max_rank": float(top) / 2 ** 30}


class Trainer:
    """One training run with seams, in the manner of torchtitan's ``Trainer``:

    ``setup()``        data checks, process groups, datasets, objective, model, optimizer (DDP / ZeRO),
                       EMA, checkpointer and resume, logger, the initial validation
    ``train_step(s)``  one optimizer step: ``grad_accum_steps`` micro-batches, gradient reductions,
                       clipping, the non-finite guard, the update and the EMA
    ``validate()``     the validation loss (and the EMA's at the end)
    ``save(s)``        a checkpoint of the current state
    ``run()``          setup, then the loop: the interval decisions (log, validate, save, signals)
    """

    def __init__(self, cfg: RunConfig, log=print):
        self.cfg, self.log = cfg, log

    # -- setup ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, tc, dc, pc = self.cfg, self.cfg.train, self.cfg.data, self.cfg.parallel
        backend = backends.get(cfg.model.attention_backend)
        if not backend.cpu_backward and not torch.cuda.is_available():
            able = ", ".join(n for n in backends.names() if backends.get(n).cpu_backward)
            raise ConfigError(f"model.attention_backend={backend.name} has no backward on CPU, so it cannot train "
                              f"here: train with one of {able} (any backend loads the weights for inference)")
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        prefixes, _ = parse_blend(dc.path)
        infos = [check_dataset(p) for p in prefixes]      # clear errors before any expensive set-up
        self.init_path = resolve_init(cfg, self.log)       # train.init_from=hf:DIR: imported once (hf_init.py)
        adopted = adopt_architecture(cfg, self.init_path)  # train.init_from's model.* fields left at their defaults
        self.tok = tok = resolve_tokenizer(cfg)
        self.vocab = resolve_vocab(cfg, tok)
        for p, info in zip(prefixes, infos):               # vocabulary, and the tokenizer the data was made with
            check_matches(p, info, self.vocab, tok if dc.check_tokenizer else None)
        validate_layout(cfg)                               # sizes against the model, before any process group
        self.env = initialize(pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size, seed=tc.seed,
                              virtual_pipeline_model_parallel_size=pc.virtual_pipeline_model_parallel_size,
                              context_parallel_size=pc.context_parallel_size)
        validate_layout(cfg, self.env.world_size)
        self.main = self.env.rank == 0
        self.lock, self.found = claim(cfg, self.env.rank)   # before anything is written to train.save_dir
        self.ft = FaultTolerance(cfg.fault, self.env.rank, tc.save_dir, lambda m: self.logger.write(m))
        if tc.check_memory:
            check_memory(cfg, padded_vocab_size(self.vocab, cfg.model.make_vocab_size_divisible_by,
                                                pc.tensor_model_parallel_size), self.env.world_size)
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        if not self.main:
            self.log = lambda *a, **k: None  # noqa: E731  (only rank 0 talks)
        if adopted:
            self.log(f"model architecture from train.init_from: {', '.join(f'{k}={v}' for k, v in adopted.items())}")
        torch.manual_seed(tc.seed)
        self._setup_data(prefixes)
        self.objective = objective_from_config(cfg, tok)
        self.model = model_for(cfg, self.vocab, sequence_parallel=pc.sequence_parallel)
        self._setup_state()
        self._setup_logging()

    def _setup_data(self, prefixes) -> None:
        tc, dc = self.cfg.train, self.cfg.data
        self.samples_per_step = tc.global_batch(self.dp)
        n_valid = max(tc.eval_iters, 1) * tc.micro_batch_size * self.dp
        self.train_ds, self.valid_ds, _ = build_splits(
            dc.path, self.tok, dc.seq_length, dc.split, dc.seed,
            (tc.train_steps * self.samples_per_step, n_valid, n_valid), dc.cache_dir, dc.check_tokenizer,
            log=self.log, fmt=dc.format, overlong=dc.sft_overlong, packing=dc.packing)
        if self.valid_ds is None or len(self.valid_ds) == 0:
            self.log("warning: no validation split (data.split gives it weight 0): validating on training samples")
            self.valid_ds = self.train_ds
        self.watch = DataWatch(prefixes)

    def _setup_state(self) -> None:
        """Weights (resumed or initialised), the optimizer backend (AdamW + DDP or ZeRO), EMA, and the training
        state."""
        cfg, tc, model, found = self.cfg, self.cfg.train, self.model, self.found
        if found is not None:
            load_resume_weights(found, model, cfg)          # before ZeRO partitions the weights
        elif tc.init_from:
            ck = load_weights(model, self.init_path, cfg.model)
            self.log(f"initialised the weights from {ck}")
            if tc.init_mask_row == "mean":
                mean_token_rows(model_chunks(model), [self.tok.mask], self.tok.vocab_size)
                self.log(f"MASK's row (token {self.tok.mask}) := the mean of the other {self.tok.vocab_size - 1} "
                         f"tokens' rows (train.init_mask_row=mean)")
        model.train()
        self.backend = optimizer_backend(model, cfg)        # AdamW (+ DDP) or a DeepSpeed ZeRO engine
        self.ema = EMA(model, tc.ema_decay) if tc.ema_decay > 0 else None   # after ZeRO-3 partitions exist
        self.checkpointer = Checkpointer(cfg, self.tok, model, self.backend, self.log, self.ema)
        self.ft.attach(getattr(self.backend, "ddp", None))  # its gradient all-reduce wait: a collective
        self.start_step, self.consumed, self.resumed = 0, 0, None
        if found is not None:
            self.resumed = self.checkpointer.load_training_state(found)
            self.start_step, self.consumed = int(self.resumed["step"]), int(self.resumed["consumed_samples"])

    def _setup_logging(self) -> None:
        cfg, tc, dc, model, resumed = self.cfg, self.cfg.train, self.cfg.data, self.model, self.resumed
        self.n_params = total_parameters(model)
        L = self.L = dc.seq_length
        self.sample_flops = flops_per_sample(cfg.model, model.padded_vocab_size, self.objective.name, L,
                                             cfg.objective.options.every_row_logits)
        self.peak = peak_flops(tc.peak_tflops)
        self.proc_per_sample = methods.get(self.objective.name).positions(L)[0]
        self.log(f"model: {self.n_params / 1e6:.2f}M parameters, vocab {self.vocab} (padded "
                 f"{model.padded_vocab_size}); objective {self.objective.name}; L={L}; {len(self.train_ds)} train / "
                 f"{len(self.valid_ds)} valid samples; layout TP={cfg.parallel.tensor_model_parallel_size} "
                 f"CP={cfg.parallel.context_parallel_size} PP={self.pp} DP={self.dp}, {self.samples_per_step} "
                 f"samples per step")
        self.logger = MetricLogger(Path(tc.save_dir), tc.train_steps, self.start_step, cfg.logging, to_dict(cfg),
                                   enabled=self.main, resume_step=self.ft.first_step(self.start_step, resumed),
                                   log_interval=tc.log_interval)
        self.bos_eos = wrap_ids(dc, self.tok)
        if resumed is None:
            init_eval = self.validate()
            self.logger.log({"val/loss": init_eval["loss"], "val/ppl": init_eval["ppl"]}, 0)
            self.logger.write(f"step 0: val loss {init_eval['loss']:.4f}")
        else:
            init_eval = {"loss": resumed.get("initial_val_loss", float("nan"))}
            self.logger.write(f"resumed from {self.found[0]} at step {self.start_step} ({self.consumed} samples "
                              f"consumed)")
        self.initial_val = init_eval["loss"]
        self.last_eval = init_eval if resumed is None else {"loss": resumed.get("val_loss", float("nan"))}
        self.guard = StepGuard(tc, int(resumed.get("skipped_steps", 0)) if resumed is not None else 0,
                               self.logger.write)
        # noise of a sample depends on (seed, epoch, sample index) only: every rank of one data-parallel
        # replica (its TP / PP ranks) sees the same inputs, and DP = 1 and DP = N train on identical inputs
        self.noise_seed = tc.seed + 1
        mbs = tc.micro_batch_size
        self.stream = batches(self.train_ds, mbs, self.consumed + self.dp_rank * mbs, self.dp * mbs, self.bos_eos)
        self.tok_window = self.proc_window = 0

    # -- one step, validation, saving -------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[float, torch.Tensor, float]:
        """One optimizer step; returns (mean loss over DP, global gradient norm, learning rate)."""
        tc, dp, objective = self.cfg.train, self.dp, self.objective
        lr = optim.lr_at(self.guard.schedule_step(step), tc)
        optim.set_lr(self.backend.optimizer, lr)
        self.backend.zero_grad()
        micro = []
        self.watch.check()                             # the data files are the ones we started with
        docs = self.documents_per_micro_batch()
        for _ in range(tc.grad_accum_steps):
            batch = next(self.stream)
            n = len(self.train_ds)                      # each row's noise epoch: its own stream position
            seeds = [self.noise_seed + step_epoch(batch.sample_index + j, n) for j in range(batch.rows)]
            micro.append(inputs_for(objective, batch, seeds))
            micro[-1].documents = docs
            self.consumed += batch.rows * dp
            self.tok_window += batch.tokens.numel() * dp
            self.proc_window += batch.rows * self.proc_per_sample * dp
        total, gnorm = self.backend.forward_backward(objective, micro, lambda: autocast_context(tc.precision))
        total = mean_over_dp(total, dp)
        if self.guard.accept(step, total, gnorm):      # every rank agrees (train.nonfinite: stop | skip)
            self.backend.apply()
            if self.ema is not None:
                self.ema.update()
        else:
            self.backend.discard()
        return total, gnorm, lr

    def documents_per_micro_batch(self) -> float | None:
        """Packed samples: the documents of this step's global batch / (micro-batches x DP), what every
        micro-batch's per-document loss divides by (the mean over the global batch's documents, however they
        fall into packs, micro-batches and ranks); None for one document per sample."""
        count = getattr(self.train_ds, "documents", None)
        if count is None:
            return None
        n = len(self.train_ds)
        total = sum(count((self.consumed + j) % n) for j in range(self.samples_per_step))
        return total / (self.cfg.train.grad_accum_steps * self.dp)

    def validate(self) -> dict:
        return evaluate(self.model, self.objective, self.valid_ds, self.cfg, max(self.cfg.train.eval_iters, 1),
                        bos_eos=self.bos_eos)

    def save(self, step: int) -> Path:
        tc = self.cfg.train
        return self.checkpointer.save(step, self.consumed, {
            "val_loss": self.last_eval["loss"], "initial_val_loss": self.initial_val, "train_steps": tc.train_steps,
            "skipped_steps": self.guard.skipped})

    def _log_step(self, done: int, total: float, gnorm, lr: float, t_window: float) -> None:
        dt = time.perf_counter() - t_window
        self.sample_tps, self.proc_tps = self.tok_window / dt, self.proc_window / dt
        tflops = self.sample_tps / self.L * self.sample_flops / self.env.world_size / 1e12      # per device
        perf = {"perf/sample_tokens_per_s": self.sample_tps, "perf/processed_tokens_per_s": self.proc_tps,
                "perf/model_tflops_per_device": tflops}
        if self.peak:
            perf["perf/mfu"] = tflops * 1e12 / self.peak
        perf.update(_memory_metrics())
        perf.update(self.ft.metrics())                     # a collective: every rank, every log interval
        self.logger.log({"train/loss": total, "train/lr": lr, "train/grad_norm": float(gnorm), **perf,
                         "data/consumed_samples": self.consumed, **self.guard.metrics()}, done)
        self.tok_window = self.proc_window = 0

    def validation_due(self, step: int) -> bool:
        """A periodic validation after ``step`` (``train.eval_interval``; the last step's is in _finish)."""
        tc = self.cfg.train
        return tc.eval_interval > 0 and step % tc.eval_interval == 0 and step != tc.train_steps

    def _finish(self) -> None:
        """The last step's validation (raw and EMA weights) and checkpoint."""
        tc = self.cfg.train
        with self.ft.phase("validate", tc.train_steps):
            self.last_eval = self.validate()
            self.logger.log({"val/loss": self.last_eval["loss"], "val/ppl": self.last_eval["ppl"]}, tc.train_steps)
            if self.ema is not None:
                with self.ema.swapped():
                    ema_eval = self.validate()
                self.last_eval["ema_loss"] = ema_eval["loss"]
                self.logger.log({"val/ema_loss": ema_eval["loss"]}, tc.train_steps)
        with self.ft.phase("save", tc.train_steps):
            self.ckpt = self.save(tc.train_steps)
            self.checkpointer.wait(tc.train_steps)

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Set up, train, and hand the run directory back (its lock is held from set-up to the summary)."""
        self.lock = self.logger = self.ft = None
        clean = False
        try:
            self.setup()
            result = self._loop()
            clean = True
            return result
        finally:
            if self.ft is not None:
                self.ft.close(clean)
            if self.logger is not None:
                self.logger.close()
            if self.lock is not None:
                self.lock.release()

    def _loop(self) -> TrainResult:
        tc, logger = self.cfg.train, self.logger
        t_window = t_start = time.perf_counter()
        self.sample_tps = self.proc_tps = 0.0
        self.ckpt, stop_signal, done = (self.found[0] if self.found is not None else None), None, self.start_step
        with ExitSignals(tc.exit_on_signal) as signals:
            for step in range(self.start_step, tc.train_steps):
                with self.ft.step(step):
                    total, gnorm, lr = self.train_step(step)
                done = step + 1
                self.checkpointer.poll(done)              # publish finished asynchronous saves
                if self.logger.due(done):
                    self._log_step(done, total, gnorm, lr, t_window)
                    t_window = time.perf_counter()
                logger.advance(1, {"loss": f"{total:.3f}", "tok/s": f"{self.sample_tps:,.0f}"})
                if self.validation_due(done):
                    with self.ft.phase("validate", done):
                        self.last_eval = self.validate()
                    logger.log({"val/loss": self.last_eval["loss"], "val/ppl": self.last_eval["ppl"]}, done)
                    logger.write(f"step {done}: train loss {total:.4f}  val loss {self.last_eval['loss']:.4f}  "
                                 f"lr {lr:.2e}  {self.sample_tps:,.0f} sample tok/s ({self.proc_tps:,.0f} "
                                 f"processed)")
                stop_signal = signals.agreed()
                if stop_signal is not None and done != tc.train_steps:
                    with self.ft.phase("save", done):
                        self.ckpt = self.save(done)
                        self.checkpointer.wait(done)
                    logger.write(f"{stop_signal} received: saved step {done} to {self.ckpt}; stopping (resume "
                                 f"with train.resume=auto)")
                    break
                if self.checkpointer.due(done):
                    with self.ft.phase("save", done):
                        self.ckpt = self.save(done)
                    self.ft.saved(done)
            else:
                if self.start_step < tc.train_steps or self.resumed is None:
                    self._finish()
                else:
                    logger.write(f"{self.found[0]} is already at train.train_steps={tc.train_steps}: nothing "
                                 f"to train")
        logger.close()
        wall = time.perf_counter() - t_start
        if self.main:
            plot_loss_curve(logger.history, Path(tc.save_dir) / "loss_curve.png",
                            f"{self.objective.name}, L={self.L}, {self.n_params / 1e6:.2f}M params")
        last = self.last_eval["loss"]
        self.log(f"{'stopped' if stop_signal else 'done'}: step {done} of {tc.train_steps} in {wall:.0f}s; val loss "
                 f"{self.initial_val:.4f} -> {last:.4f} (ppl {math.exp(min(last, 50)):.2f}); checkpoint {self.ckpt}")
        result = TrainResult(final_step=done, initial_val_loss=self.initial_val, final_val_loss=last,
                             checkpoint=str(self.ckpt), history=logger.history, sample_tokens_per_s=self.sample_tps,
                             processed_tokens_per_s=self.proc_tps, num_parameters=self.n_params,
                             stopped_by=stop_signal, final_val_loss_ema=self.last_eval.get("ema_loss"))
        if self.main:                     # one summary per run, written while the run still holds save_dir
            (Path(tc.save_dir) / "summary.json").write_text(json.dumps(result.summary(), indent=2))
        return result


def train(cfg: RunConfig, log=print) -> TrainResult:
    """Run a full training job as configured; returns losses, throughput and the checkpoint path."""
    return Trainer(cfg, log).run()


__all__ = ["Trainer", "train", "evaluate", "TrainResult", "TrainingError", "objective_from_config",
           "resolve_tokenizer"]
