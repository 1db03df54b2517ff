"""The config sections: one dataclass per component (model, objective, data, train, logging, parallel),
each with its own ``check`` and derived values, and the cross-section :func:`validate` /
:func:`validate_layout` (ConfigError naming the field and the fix). Loading (YAML, dotted overrides,
type coercion) is :mod:`.loading`; the package re-exports both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

from setdiff_mega import backends, methods

from .errors import ConfigError
from .model import ModelConfig, _at_least_one, _choice
from .objective import ObjectiveConfig

OBJECTIVE_NAMES = methods.names()                # the registry (setdiff_mega/methods.py)


@dataclass
class DataConfig:
    path: str = "data/embedded/corpus"           # prefix of <path>.bin/.idx, or a blend "0.7 pre/a 0.3 pre/b"
    tokenizer: Optional[str] = None              # None = tokenizer.json next to the data
    seq_length: int = 128                        # L
    split: str = "96,2,2"                        # train, valid, test weights over documents
    seed: int = 1234
    cache_dir: Optional[str] = None              # None = <data dir>/cache
    chunk_bos_eos: bool = False                  # wrap convention: force BOS first / EOS last in each pretraining
                                                 # chunk (supervised samples keep their own)
    check_tokenizer: bool = True                 # refuse data whose manifest names another tokenizer
    format: str = "pretrain"                     # pretrain (documents packed into L-token chunks) | sft
                                                 # (conversations with a target mask: data/supervised.py)
    sft_overlong: str = "truncate"               # sft: a conversation longer than L: truncate | drop | error
    packing: bool = False                        # sft: several conversations per L-token sample (first-fit by
                                                 # length, none split; attention and order per conversation)

    def check(self) -> None:
        if self.seq_length < 2:
            raise ConfigError(f"data.seq_length={self.seq_length} must be >= 2")
        if self.format not in ("pretrain", "sft"):
            raise ConfigError(f"data.format={self.format!r} is not one of pretrain, sft")
        if self.sft_overlong not in ("truncate", "drop", "error"):
            raise ConfigError(f"data.sft_overlong={self.sft_overlong!r} is not one of truncate, drop, error")
        if self.packing and self.format != "sft":
            raise ConfigError("data.packing packs supervised conversations (data.format=sft); pretraining data is "
                              "already cut into full L-token chunks: remove data.packing")
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(x) for x in parts]
        except ValueError:
            raise ConfigError(f"data.split={self.split!r} must be comma-separated weights like '96,2,2'") from None
        if len(weights) != 3 or any(w < 0 for w in weights) or weights[0] <= 0:
            raise ConfigError(f"data.split={self.split!r} needs three non-negative weights with a positive train "
                              f"weight")


@dataclass
class TrainConfig:
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    train_steps: int = 400
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_schedule: str = "constant"                # constant | cosine | linear | wsd
    warmup_steps: int = 20
    decay_fraction: float = 0.2                  # wsd: final fraction of steps spent decaying
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    nonfinite: str = "stop"                      # a NaN / inf loss or gradient: stop | skip (discard the update)
    max_skipped_steps: int = 10                  # skip: stop after this many non-finite steps in a row
    spike_factor: float = 0.0                    # warn when a step's loss exceeds factor x its running mean (0 = off)
    ema_decay: float = 0.0                       # EMA of the weights after every step (0 = off; reference 0.9999)
    seed: int = 1234
    precision: str = "fp32"                      # fp32 | bf16
    eval_interval: int = 100
    eval_iters: int = 8
    log_interval: int = 10
    save_dir: str = "runs/default"
    save_interval: int = 0                       # 0 = save only at the end (and on SIGTERM / SIGUSR1)
    keep_last: int = 2                           # complete checkpoints kept (0 = all)
    checkpoint_checksums: bool = True            # SHA-256 of every checkpoint file, verified on load
    async_save: bool = False                     # periodic saves written by forked writers while training goes on
                                                 # (megatron-core's async save; published when every rank is done)
    resume: str = "auto"                         # auto (newest complete checkpoint in save_dir) | none | a path
    overwrite: bool = False                      # a new run where another run's checkpoints are: remove them first
    check_memory: bool = True                    # refuse a run whose estimated memory per rank exceeds the machine's
    resume_optimizer: bool = True                # false: resume weights + data position, fresh optimizer
    exit_on_signal: bool = True                  # SIGTERM / SIGUSR1: save at the end of the step and stop
    num_threads: Optional[int] = None            # torch intra-op threads (None = torch default)
    init_from: Optional[str] = None              # start from a checkpoint's weights (any TP/PP layout); hf:DIR:
                                                 # a Hugging Face model, imported once (checkpoint/hf_init.py)
    init_architecture: bool = True               # and its model.* architecture (Megatron's --use-checkpoint-args)
    init_mask_row: str = "keep"                  # keep | mean: the MASK token's embedding / head row of init_from's
                                                 # weights := the mean of the other tokens' rows (method.md 15)
    zero_stage: int = 0                          # 0: project AdamW; 1/2/3: DeepSpeed ZeRO over the DP group
    peak_tflops: Optional[float] = None          # per-device dense bf16 peak for MFU (None: known GPUs only)

    def global_batch(self, dp: int = 1) -> int:
        """Samples per optimizer step over ``dp`` data-parallel replicas."""
        return self.micro_batch_size * self.grad_accum_steps * dp

    def check(self) -> None:
        _choice(self.precision, ("fp32", "bf16"), "train.precision")
        _choice(self.lr_schedule, ("constant", "cosine", "linear", "wsd"), "train.lr_schedule")
        _at_least_one(("train.micro_batch_size", self.micro_batch_size), ("train.train_steps", self.train_steps),
                      ("train.grad_accum_steps", self.grad_accum_steps))
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"train.lr={self.lr} must be > 0 and train.min_lr={self.min_lr} in [0, lr]")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"train.num_threads={self.num_threads} must be >= 1 (or null for torch's default)")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"train.ema_decay={self.ema_decay} must be in [0, 1) (0 = no EMA; the diffusion repos "
                              f"use 0.9999)")
        _choice(self.nonfinite, ("stop", "skip"), "train.nonfinite")
        _choice(self.init_mask_row, ("keep", "mean"), "train.init_mask_row")
        if self.init_mask_row != "keep" and not self.init_from:
            raise ConfigError(f"train.init_mask_row={self.init_mask_row} re-initialises the MASK row of the weights "
                              f"train.init_from starts from; set train.init_from (or leave train.init_mask_row=keep)")
        if self.max_skipped_steps < 0 or not (self.spike_factor == 0 or self.spike_factor > 1):
            raise ConfigError(f"train.max_skipped_steps={self.max_skipped_steps} must be >= 0 and "
                              f"train.spike_factor={self.spike_factor} 0 (off) or > 1")
        if self.nonfinite == "skip" and self.zero_stage > 0:
            raise ConfigError(f"train.nonfinite=skip is not supported with DeepSpeed ZeRO (train.zero_stage="
                              f"{self.zero_stage}: the engine owns the update); use train.nonfinite=stop")


@dataclass
class LoggingConfig:
    wandb: str = "offline"                       # offline | online | disabled
    project: str = "setdiff-mega"
    run_name: Optional[str] = None
    progress: bool = True                        # tqdm progress bar
    jsonl: bool = True                           # metrics.jsonl in save_dir
    tensorboard: bool = False                    # TensorBoard event files in save_dir/tensorboard

    def check(self) -> None:
        _choice(self.wandb, ("offline", "online", "disabled"), "logging.wandb")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1          # TP: splits heads / MLP / vocab over ranks
    pipeline_model_parallel_size: int = 1        # PP: splits layers over stages (megatron-core 1F1B)
    virtual_pipeline_model_parallel_size: Optional[int] = None   # V >= 2: V model chunks per stage,
                                                 # interleaved 1F1B (smaller pipeline bubble)
    sequence_parallel: bool = False              # SP (needs TP > 1): norms / dropout on sequence shards
    context_parallel_size: int = 1               # CP: every stream of a sample split over CP ranks
                                                 # (parallel/context.py); DP = world / (TP * CP * PP)
    overlap_grad_reduce: bool = True             # DP x CP gradient buckets all-reduced during the backward
                                                 # (megatron-core DDP, parallel/ddp.py; no ZeRO)
    ddp_bucket_size: int = 0                     # elements per gradient bucket; 0 = megatron-core's default
                                                 # max(40M, 1M x DP)


@dataclass
class FaultConfig:
    """Hang detection, restarts and straggler reports (setdiff_mega/resilience; docs/guide/multinode.md)."""
    watchdog: bool = True                        # a heartbeat per rank, watched by a process outside the trainer
    hang_timeout: float = 0.0                    # seconds without progress that count as a hang (0: derived)
    hang_factor: float = 5.0                     # derived timeout = factor x the longest measured step / save /
    hang_min_timeout: float = 60.0               # validation, and at least this; a kind not measured yet
    startup_timeout: float = 900.0               # (set-up, the first step, the first save) gets this
    heartbeat_poll: float = 1.0                  # the watchdog's period (at most a quarter of the timeout)
    max_same_step_failures: int = 2              # launch.sh --max-restarts: stop when failures repeat at one step
    straggler_factor: float = 1.5                # warn when a rank's compute time > factor x the median rank's
    straggler_patience: int = 3                  # ... at this many log intervals in a row (the same rank)

    def check(self) -> None:
        if self.hang_timeout < 0 or self.hang_min_timeout <= 0 or self.startup_timeout <= 0:
            raise ConfigError(f"fault.hang_timeout={self.hang_timeout} must be >= 0 (0: derived) and "
                              f"fault.hang_min_timeout={self.hang_min_timeout}, fault.startup_timeout="
                              f"{self.startup_timeout} > 0 (seconds)")
        if self.hang_factor <= 1 or self.straggler_factor <= 1:
            raise ConfigError(f"fault.hang_factor={self.hang_factor} and fault.straggler_factor="
                              f"{self.straggler_factor} must be > 1")
        if self.heartbeat_poll <= 0 or self.max_same_step_failures < 1 or self.straggler_patience < 1:
            raise ConfigError(f"fault.heartbeat_poll={self.heartbeat_poll} must be > 0, "
                              f"fault.max_same_step_failures={self.max_same_step_failures} and "
                              f"fault.straggler_patience={self.straggler_patience} >= 1")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)


# -------------------------------------------------------------------------------- validation


def validate(cfg: RunConfig) -> RunConfig:
    """Every section's own checks (``<Section>.check``), then the layout across sections; raises a
    ConfigError naming the field and the fix."""
    for section in fields(cfg):              # NaN / inf pass every comparison below: refuse them first
        part = getattr(cfg, section.name)
        part = getattr(part, "options", part)
        for f in fields(part):
            v = getattr(part, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{section.name}.{f.name}={v} is not a finite number")
    cfg.data.check()
    cfg.objective.check(cfg.data.seq_length)
    cfg.model.check(cfg.parallel.tensor_model_parallel_size)
    cfg.train.check()
    cfg.logging.check()
    cfg.fault.check()
    if cfg.data.packing and not backends.get(cfg.model.attention_backend).packed_documents:
        able = ", ".join(n for n in backends.names() if backends.get(n).packed_documents)
        raise ConfigError(f"data.packing needs a core attention that keeps each packed conversation to itself "
                          f"(model.attention_backend={able}); model.attention_backend={cfg.model.attention_backend} "
                          f"does not: use one of them, or data.packing=false")
    validate_layout(cfg)
    return cfg


def validate_layout(cfg: RunConfig, world_size: int | None = None) -> None:
    """TP / PP / DP sizes against the model and the world; every message names the sizes."""
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ConfigError(f"parallel sizes must be >= 1 (TP={tp}, PP={pp})")
    groups = m.query_groups
    if m.num_attention_heads % tp:
        raise ConfigError(f"TP={tp} does not divide model.num_attention_heads={m.num_attention_heads}; "
                          f"choose a TP size that divides the head count")
    if groups % tp:
        raise ConfigError(f"TP={tp} does not divide the {groups} KV groups (model.num_query_groups)")
    ffn = m.ffn_size
    if ffn % tp:
        raise ConfigError(f"TP={tp} does not divide the MLP width {ffn} (model.ffn_hidden_size)")
    if p.sequence_parallel:
        if tp == 1:
            raise ConfigError("parallel.sequence_parallel needs TP > 1 (it shards the sequence over the TP group)")
        if cfg.train.zero_stage > 0:
            raise ConfigError("parallel.sequence_parallel is not supported with DeepSpeed ZeRO (train.zero_stage="
                              f"{cfg.train.zero_stage}); use one of them")
        L, cp = cfg.data.seq_length, max(p.context_parallel_size, 1)
        method = methods.get(cfg.objective.name)
        T = method.positions(L)[0]         # this rank's positions (under CP each stream padded to 2 x CP chunks)
        T = T if cp == 1 else method.streams * -(-(T // method.streams) // (2 * cp)) * 2
        processed = "processed positions" if cp == 1 else f"positions each of the CP={cp} ranks processes"
        if T % tp:
            raise ConfigError(f"sequence parallelism splits the {T} {processed} (objective "
                              f"{cfg.objective.name}, L={L}) over TP={tp}; choose data.seq_length so they divide")
    if m.qk_layernorm and tp > 1 and cfg.train.zero_stage > 0:
        raise ConfigError(f"model.qk_layernorm with TP={tp} sums the q / k norms' gradients over the TP group, which "
                          f"DeepSpeed ZeRO (train.zero_stage={cfg.train.zero_stage}) does not do: use "
                          f"train.zero_stage=0 or TP=1")
    if pp > m.num_layers:
        raise ConfigError(f"PP={pp} is larger than model.num_layers={m.num_layers}; every stage needs a layer")
    if m.num_layers % pp:
        raise ConfigError(f"PP={pp} does not divide model.num_layers={m.num_layers} into equal stages")
    vp = p.virtual_pipeline_model_parallel_size
    per_stage = m.num_layers // (pp * (vp or 1))
    if m.recompute_method == "block" and (m.recompute_num_layers or 0) > per_stage:
        raise ConfigError(f"model.recompute_method=block recomputes the first recompute_num_layers="
                          f"{m.recompute_num_layers} layers of each model chunk, which has {per_stage}: choose at most "
                          f"{per_stage}")
    if vp is not None:
        tc = cfg.train
        if vp < 2 or pp < 2:
            raise ConfigError(f"parallel.virtual_pipeline_model_parallel_size={vp} needs V >= 2 and PP >= 2 (PP={pp}); "
                              f"remove it for the plain 1F1B schedule")
        if m.num_layers % (pp * vp):
            raise ConfigError(f"PP={pp} x V={vp} = {pp * vp} model chunks do not divide model.num_layers="
                              f"{m.num_layers}; choose V so that layers / (PP x V) is a whole number")
        if tc.grad_accum_steps % pp:
            raise ConfigError(f"the interleaved schedule runs micro-batches in groups of PP={pp}: "
                              f"train.grad_accum_steps={tc.grad_accum_steps} must be a multiple of {pp}")
        if tc.micro_batch_size % pp:
            raise ConfigError(f"with interleaved stages, validation splits each micro-batch into PP={pp} parts: "
                              f"train.micro_batch_size={tc.micro_batch_size} must be a multiple of {pp}")
    if cfg.train.keep_last < 0 or cfg.train.save_interval < 0:
        raise ConfigError(f"train.keep_last={cfg.train.keep_last} and train.save_interval={cfg.train.save_interval} "
                          f"must be >= 0 (0 = keep all / save only at the end)")
    if not 0 <= cfg.train.zero_stage <= 3:
        raise ConfigError(f"train.zero_stage={cfg.train.zero_stage} must be 0 (off), 1, 2 or 3")
    if cfg.train.async_save and cfg.train.zero_stage > 0:
        raise ConfigError(f"train.async_save writes megatron-core shards; DeepSpeed ZeRO (train.zero_stage="
                          f"{cfg.train.zero_stage}) saves its own state synchronously: use train.async_save=false")
    if pp > 1 and cfg.train.zero_stage > 0:
        raise ConfigError(f"DeepSpeed ZeRO (train.zero_stage={cfg.train.zero_stage}) is not supported together with "
                          f"PP={pp} (megatron-core's pipeline schedule drives the model); use PP=1 or zero_stage=0")
    if p.ddp_bucket_size < 0:
        raise ConfigError(f"parallel.ddp_bucket_size={p.ddp_bucket_size} must be >= 0 (0 = megatron-core's default)")
    cp = p.context_parallel_size
    if cp != 1:
        _check_context_parallel(cfg, cp)
    if world_size is not None and world_size % (tp * cp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by TP*CP*PP = {tp}*{cp}*{pp} = {tp * cp * pp}; "
                          f"launch a multiple of {tp * cp * pp} processes")


def _check_context_parallel(cfg: RunConfig, cp: int) -> None:
    """CP sizes against the sequence, the attention backend and the other features."""
    L, m = cfg.data.seq_length, cfg.model
    if cp < 1:
        raise ConfigError(f"parallel.context_parallel_size={cp} must be >= 1")
    if m.shift_logits:
        raise ConfigError(f"model.shift_logits reads each target's logits from its predecessor's row, which under "
                          f"parallel.context_parallel_size={cp} may live on another rank: use CP=1 (or "
                          f"model.shift_logits=false)")
    if cfg.objective.options.every_row_logits:
        raise ConfigError(f"objective.name={cfg.objective.name} with {'; '.join(cfg.objective.options.describe())} "
                          f"reads logits on rows that under parallel.context_parallel_size={cp} may live on another "
                          f"rank: use CP=1 (or leave that option at its default)")
    if cfg.data.packing:
        raise ConfigError(f"packed samples keep every conversation's attention and order to itself, which "
                          f"parallel.context_parallel_size={cp} cuts into chunks over ranks: use data.packing=false "
                          f"(padded conversations) with CP, or CP=1")
    if L % (2 * cp):
        raise ConfigError(f"context parallelism cuts every stream into 2 x CP = {2 * cp} chunks: data.seq_length={L} "
                          f"must be a multiple of {2 * cp}")
    if not backends.get(m.attention_backend).context_parallel:
        able = ", ".join(n for n in backends.names() if backends.get(n).context_parallel)
        raise ConfigError(f"parallel.context_parallel_size={cp} needs a core attention that gathers keys over the "
                          f"CP group (model.attention_backend={able}); model.attention_backend={m.attention_backend} "
                          f"does not")


__all__ = ["ConfigError", "ParallelConfig", "validate_layout", "ModelConfig", "ObjectiveConfig", "DataConfig",
           "TrainConfig", "LoggingConfig", "RunConfig", "validate", "OBJECTIVE_NAMES"]
