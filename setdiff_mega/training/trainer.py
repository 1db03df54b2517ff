"""The training loop: config -> data -> model + objective -> optimizer -> checkpoint.

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
resume (``train.resume=auto``) and SIGTERM / SIGUSR1 handling are in :mod:`.checkpointer`.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from setdiff_mega import methods
from setdiff_mega.build import model_for
from setdiff_mega.build import objective_for as objective_from_config
from setdiff_mega.build import tokenizer_for as resolve_tokenizer
from setdiff_mega.build import vocab_for as resolve_vocab
from setdiff_mega.config import RunConfig, to_dict
from setdiff_mega.data.indexed import DataWatch, check_dataset, check_matches
from setdiff_mega.diffusion import build_inputs_per_sample

from .guard import StepGuard, TrainingError


def autocast_context(precision: str):
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)


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


@torch.no_grad()
def evaluate(model, objective, dataset, cfg: RunConfig, iters: int, seed: int = 0, bos_eos=None) -> dict:
    """Validation on the first ``iters * micro_batch_size * DP`` samples, split over the data-parallel
    ranks, with per-sample noise: the result does not depend on the parallel layout.

    ``loss`` is the token-weighted NLL (sum of per-token NLL / number of scored tokens; for packed data
    without padding it equals the training loss's per-sequence mean), ``ppl`` its exponential.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from setdiff_mega.data.loader import batches

    from .step import evaluate_batch

    was_training = model.training
    model.eval()
    mbs = cfg.train.micro_batch_size
    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    dp_rank = ps.get_data_parallel_rank() if ps.model_parallel_is_initialized() else 0
    sums = torch.zeros(2, dtype=torch.float64)
    it = batches(dataset, mbs, dp_rank * mbs, dp * mbs, bos_eos=bos_eos)
    # interleaved pipeline stages need >= PP micro-batches per schedule run: split each batch into PP parts
    parts = ps.get_pipeline_model_parallel_world_size() \
        if ps.model_parallel_is_initialized() and ps.get_virtual_pipeline_model_parallel_world_size() else 1
    for _ in range(iters):
        batch = next(it)
        ids = batch["sample_ids"]
        step = len(ids) // parts
        micro = [build_inputs_per_sample(objective, batch["tokens"][j:j + step], ids[j:j + step], seed,
                                         training=False) for j in range(0, len(ids), step)]
        s, n = evaluate_batch(model, objective, micro, lambda: autocast_context(cfg.train.precision))
        sums += torch.tensor([s, n], dtype=torch.float64)
    if dp > 1:
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
    model.train(was_training)
    mean_nll = float(sums[0] / sums[1].clamp(min=1.0))
    return {"loss": mean_nll, "nll_per_token": mean_nll, "ppl": math.exp(min(mean_nll, 50))}


def train(cfg: RunConfig, log=print) -> TrainResult:
    """Run a full training job as configured; returns losses, throughput and the checkpoint path."""
    from megatron.core import parallel_state as ps

    from setdiff_mega.checkpoint import load_weights
    from setdiff_mega.config import validate_layout
    from setdiff_mega.data.loader import batches, build_splits, parse_blend, wrap_ids
    from setdiff_mega.parallel import initialize

    from .checkpointer import Checkpointer, ExitSignals
    from .flops import flops_per_sample, peak_flops
    from .loggers import MetricLogger, plot_loss_curve
    from .optim import build_optimizer, lr_at, set_lr
    from .step import allreduce_dp_grads, allreduce_sequence_parallel_grads, clip_grad_norm, forward_backward

    tc, dc = cfg.train, cfg.data
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    prefixes, _ = parse_blend(dc.path)
    infos = [check_dataset(p) for p in prefixes]      # clear errors before any expensive set-up
    tok = resolve_tokenizer(cfg)
    vocab = resolve_vocab(cfg, tok)
    for p, info in zip(prefixes, infos):               # vocabulary, and the tokenizer the data was made with
        check_matches(p, info, vocab, tok if dc.check_tokenizer else None)
    pc = cfg.parallel
    validate_layout(cfg)                               # sizes against the model, before any process group
    env = initialize(pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size, seed=tc.seed,
                     virtual_pipeline_model_parallel_size=pc.virtual_pipeline_model_parallel_size)
    validate_layout(cfg, env.world_size)
    main = env.rank == 0
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    pp = ps.get_pipeline_model_parallel_world_size()
    if not main:
        log = lambda *a, **k: None  # noqa: E731  (only rank 0 talks)
    torch.manual_seed(tc.seed)
    samples_per_step = tc.global_batch(dp)
    n_valid = max(tc.eval_iters, 1) * tc.micro_batch_size * dp
    train_ds, valid_ds, _ = build_splits(dc.path, tok, dc.seq_length, dc.split, dc.seed,
                                         (tc.train_steps * samples_per_step, n_valid, n_valid), dc.cache_dir,
                                         dc.check_tokenizer)
    if valid_ds is None or len(valid_ds) == 0:
        log("warning: no validation split (data.split gives it weight 0): validating on training samples")
        valid_ds = train_ds
    watch = DataWatch(prefixes)
    objective = objective_from_config(cfg, tok)
    model = model_for(cfg, vocab, sequence_parallel=pc.sequence_parallel)
    checkpointer = Checkpointer(cfg, tok, model, None, None, log)
    found = checkpointer.find()
    if found is not None:
        checkpointer.load_weights(found)
    elif tc.init_from:
        ck = load_weights(model, tc.init_from, cfg.model)
        log(f"initialised the weights from {ck}")
    model.train()
    optimizer = build_optimizer(model, tc)
    ddp = model
    engine = None
    if tc.zero_stage > 0:
        from setdiff_mega.parallel.zero import zero_engine

        engine = zero_engine(model, optimizer, tc)
        optimizer = engine.optimizer
    elif dp > 1 and pp == 1:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, broadcast_buffers=False, process_group=ps.get_data_parallel_group())
    checkpointer.optimizer, checkpointer.engine = optimizer, engine
    ema = None
    if tc.ema_decay > 0:
        from .ema import EMA

        ema = checkpointer.ema = EMA(model, tc.ema_decay)        # after the engine: ZeRO-3 partitions exist
    start_step, consumed, resumed = 0, 0, None
    if found is not None:
        resumed = checkpointer.load_training_state(found)
        start_step, consumed = int(resumed["step"]), int(resumed["consumed_samples"])
    n_params = _total_parameters(model)
    L = dc.seq_length
    sample_flops = flops_per_sample(cfg.model, model.padded_vocab_size, objective.name, L)
    peak = peak_flops(tc.peak_tflops)
    proc_per_sample = methods.get(objective.name).positions(L)[0]
    save_dir = Path(tc.save_dir)
    log(f"model: {n_params / 1e6:.2f}M parameters, vocab {vocab} (padded {model.padded_vocab_size}); "
        f"objective {objective.name}; L={L}; {len(train_ds)} train / {len(valid_ds)} valid samples; "
        f"layout TP={pc.tensor_model_parallel_size} PP={pp} DP={dp}, {samples_per_step} samples per step")
    logger = MetricLogger(save_dir, tc.train_steps, start_step, cfg.logging, to_dict(cfg), enabled=main,
                          resume_step=start_step if resumed is not None else None)
    eval_iters = max(tc.eval_iters, 1)
    bos_eos = wrap_ids(dc, tok)
    if resumed is None:
        init_eval = evaluate(model, objective, valid_ds, cfg, eval_iters, bos_eos=bos_eos)
        logger.log({"val/loss": init_eval["loss"], "val/ppl": init_eval["ppl"]}, 0)
        logger.write(f"step 0: val loss {init_eval['loss']:.4f}")
    else:
        init_eval = {"loss": resumed.get("initial_val_loss", float("nan"))}
        logger.write(f"resumed from {found[0]} at step {start_step} ({consumed} samples consumed)")
    initial_val = init_eval["loss"]
    guard = StepGuard(tc, int(resumed.get("skipped_steps", 0)) if resumed is not None else 0, logger.write)
    # noise of a sample depends on (seed, epoch, sample index) only: every rank of one data-parallel
    # replica (its TP / PP ranks) sees the same inputs, and DP = 1 and DP = N train on identical inputs
    noise_seed = tc.seed + 1
    stream = batches(train_ds, tc.micro_batch_size, consumed + dp_rank * tc.micro_batch_size,
                     dp * tc.micro_batch_size, bos_eos)
    last_eval = init_eval if resumed is None else {"loss": resumed.get("val_loss", float("nan"))}
    t_window, tok_window, proc_window = time.perf_counter(), 0, 0
    t_start = time.perf_counter()
    sample_tps = proc_tps = 0.0
    ckpt, stop_signal, done = (found[0] if found is not None else None), None, start_step

    def save(at_step):
        return checkpointer.save(at_step, consumed, {"val_loss": last_eval["loss"], "initial_val_loss": initial_val,
                                                     "train_steps": tc.train_steps, "skipped_steps": guard.skipped})

    try:
        with ExitSignals(tc.exit_on_signal) as signals:
            for step in range(start_step, tc.train_steps):
                lr = lr_at(guard.schedule_step(step), tc)
                set_lr(optimizer, lr)
                optimizer.zero_grad(set_to_none=True)
                micro = []
                watch.check()                              # the data files are the ones we started with
                for _ in range(tc.grad_accum_steps):
                    batch = next(stream)
                    tokens = batch["tokens"]
                    seed = noise_seed + step_epoch(batch["sample_index"], len(train_ds))
                    micro.append(build_inputs_per_sample(objective, tokens, batch["sample_ids"], seed))
                    consumed += tokens.shape[0] * dp
                    tok_window += tokens.numel() * dp
                    proc_window += tokens.shape[0] * proc_per_sample * dp
                if engine is not None:     # DeepSpeed: accumulation, DP reduction, clipping and the update
                    total, gnorm = _zero_step(engine, objective, micro, lambda: autocast_context(tc.precision))
                else:
                    total = forward_backward(model, ddp, objective, micro, lambda: autocast_context(tc.precision))
                    if pc.sequence_parallel:
                        allreduce_sequence_parallel_grads(model)
                    if pp > 1:
                        allreduce_dp_grads(model)
                    gnorm = clip_grad_norm(model, tc.clip_grad)
                total = _mean_over_ranks(total, dp)
                if guard.accept(step, total, gnorm):       # every rank agrees (train.nonfinite: stop | skip)
                    if engine is None:
                        optimizer.step()
                    if ema is not None:
                        ema.update()
                else:
                    optimizer.zero_grad(set_to_none=True)
                done = step + 1
                if done % tc.log_interval == 0 or done == tc.train_steps:
                    dt = time.perf_counter() - t_window
                    sample_tps, proc_tps = tok_window / dt, proc_window / dt
                    tflops = sample_tps / L * sample_flops / env.world_size / 1e12      # per device
                    perf = {"perf/sample_tokens_per_s": sample_tps, "perf/processed_tokens_per_s": proc_tps,
                            "perf/model_tflops_per_device": tflops}
                    if peak:
                        perf["perf/mfu"] = tflops * 1e12 / peak
                    logger.log({"train/loss": total, "train/lr": lr, "train/grad_norm": float(gnorm), **perf,
                                "data/consumed_samples": consumed, **guard.metrics()}, done)
                    t_window, tok_window, proc_window = time.perf_counter(), 0, 0
                logger.advance(1, {"loss": f"{total:.3f}", "tok/s": f"{sample_tps:,.0f}"})
                if tc.eval_interval > 0 and done % tc.eval_interval == 0 and done != tc.train_steps:
                    last_eval = evaluate(model, objective, valid_ds, cfg, eval_iters, bos_eos=bos_eos)
                    logger.log({"val/loss": last_eval["loss"], "val/ppl": last_eval["ppl"]}, done)
                    logger.write(f"step {done}: train loss {total:.4f}  val loss {last_eval['loss']:.4f}  "
                                 f"lr {lr:.2e}  {sample_tps:,.0f} sample tok/s ({proc_tps:,.0f} processed)")
                stop_signal = signals.agreed()
                if stop_signal is not None and done != tc.train_steps:
                    ckpt = save(done)
                    logger.write(f"{stop_signal} received: saved step {done} to {ckpt}; stopping (resume with "
                                 f"train.resume=auto)")
                    break
                if tc.save_interval > 0 and done % tc.save_interval == 0 and done != tc.train_steps:
                    ckpt = save(done)
            else:
                if start_step < tc.train_steps or resumed is None:
                    last_eval = evaluate(model, objective, valid_ds, cfg, eval_iters, bos_eos=bos_eos)
                    logger.log({"val/loss": last_eval["loss"], "val/ppl": last_eval["ppl"]}, tc.train_steps)
                    if ema is not None:
                        with ema.swapped():
                            ema_eval = evaluate(model, objective, valid_ds, cfg, eval_iters, bos_eos=bos_eos)
                        last_eval["ema_loss"] = ema_eval["loss"]
                        logger.log({"val/ema_loss": ema_eval["loss"]}, tc.train_steps)
                    ckpt = save(tc.train_steps)
                else:
                    logger.write(f"{found[0]} is already at train.train_steps={tc.train_steps}: nothing to train")
    finally:
        logger.close()
    wall = time.perf_counter() - t_start
    if main:
        plot_loss_curve(logger.history, save_dir / "loss_curve.png",
                        f"{objective.name}, L={L}, {n_params / 1e6:.2f}M params")
    log(f"{'stopped' if stop_signal else 'done'}: step {done} of {tc.train_steps} in {wall:.0f}s; val loss "
        f"{initial_val:.4f} -> {last_eval['loss']:.4f} (ppl {math.exp(min(last_eval['loss'], 50)):.2f}); "
        f"checkpoint {ckpt}")
    return TrainResult(final_step=done, initial_val_loss=initial_val,
                       final_val_loss=last_eval["loss"], checkpoint=str(ckpt), history=logger.history,
                       sample_tokens_per_s=sample_tps, processed_tokens_per_s=proc_tps, num_parameters=n_params,
                       stopped_by=stop_signal, final_val_loss_ema=last_eval.get("ema_loss"))


def _mean_over_ranks(value: float, dp: int) -> float:
    """Mean of a per-replica value over the data-parallel group (all TP / PP ranks of a replica hold the
    same value, so a NaN on any rank still reaches every rank)."""
    if dp == 1:
        return value
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t.item() / dp


def _zero_step(engine, objective, micro, autocast):
    """One optimizer step through a DeepSpeed engine; a non-finite loss on any rank stops before the update."""
    import torch.distributed as dist

    total = 0.0
    for inp in micro:
        with autocast():
            logits = engine(**inp.model_kwargs())
            loss, _ = objective.loss(logits, inp)
        bad = torch.tensor([0.0 if math.isfinite(loss.item()) else 1.0])
        dist.all_reduce(bad)
        if bad.item():
            raise TrainingError(f"non-finite loss on {int(bad.item())} rank(s); no update was applied. Lower "
                                f"train.lr or use train.precision=fp32")
        engine.backward(loss)          # scaled by 1 / gradient_accumulation_steps inside DeepSpeed
        engine.step()                  # the optimizer steps at the accumulation boundary
        total += loss.item() / len(micro)
    norm = engine.get_global_grad_norm()
    return total, torch.tensor(float(norm) if norm is not None else 0.0)


def step_epoch(sample_index: int, n: int) -> int:
    """Epoch of a sample position in the (wrapping) sample stream, so repeated samples get fresh noise."""
    return (sample_index // max(n, 1)) * 7919


def _total_parameters(model) -> int:
    """Parameters of the whole model (all TP shards and PP stages, replicated ones counted once; under
    ZeRO-3 a partitioned parameter's full size is its ``ds_numel``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    n = torch.tensor([sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()
                          if param_is_not_tensor_parallel_duplicate(p))])
    group = ps.get_model_parallel_group()
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(n, group=group)
    return int(n)


__all__ = ["train", "evaluate", "TrainResult", "TrainingError", "objective_from_config", "resolve_tokenizer"]
