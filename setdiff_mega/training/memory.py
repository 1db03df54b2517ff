"""Memory per rank of a training configuration and layout (``tools/estimate_memory.py``).

Per rank, in bytes (b = micro-batch size, T = positions per sample of the objective, N = positions with
logits, h = hidden size, f = MLP width, V = padded vocabulary, l = layers per pipeline stage):

    parameters   P_rank = (body / PP + embedding and / or head of this stage) / TP      (largest stage)
    weights      P_rank x w, w = 2 (train.precision=bf16: bf16 parameters) or 4; / DP under ZeRO-3
    gradients    P_rank x w (/ DP under ZeRO >= 2)
    AdamW        P_rank x 2w (m and v in the parameters' dtype; / DP under ZeRO >= 1)
    EMA          4 bytes per parameter (train.ema_decay > 0)
    activations  per micro-batch in flight (PP = 1: 1; 1F1B: min(PP, micro-batches) on the first stage):
                 layers  l x a x b x T_loc x (6.5 h + (5 h + k f) / TP) (k = 2 GELU, 4 SwiGLU; the
                         coefficients measured on this stack: the tensors autograd keeps for the backward,
                         ``tests/unit/test_memory.py``), T_loc = T / CP (each stream padded to 2 CP chunks)
                 mask    b|1 x T_loc x T bytes (bool; the dense mask; cached static mask: b = 1); under CP
                         the rank's rows, built from the mask's pattern (no full T x T mask) by the sdpa
                         backend only (setcausal on SetDLM and flex build none)
                 head    N_loc x b x (4 V + 8 h) (the fp32 log-probabilities, the head input) + T_loc x b x 4h;
                         the loss's backward adds 3 x N_loc x b x 4 V (fp32 gradients of the log-probabilities
                         and the logits) while everything above is still kept: the workspace of the step is
                         the larger of that and a recomputed unit's activations
                 a = 2 bytes under bf16 autocast, 4 in fp32
                 recomputation: full/uniform n keeps each unit's input (l / n x b T_loc h x a) plus one
                 unit's activations during its backward; full/block n keeps the inputs of the n
                 recomputed layers and the activations of the l - n others (the recomputed layers' backward
                 comes after the others' activations are freed: one layer's worth only if n = l);
                 selective (core attention) saves nothing on these kernels (the SDPA kernels keep no
                 T x T tensor; q, k, v and the output are kept by the linear layers anyway), so it is
                 counted as none

The estimate ignores allocator fragmentation, communication buffers and the framework's own footprint
(imports, CUDA context), which a process's RSS or ``cuda.max_memory_allocated`` includes.

:func:`measure_step_peak` measures what the estimate predicts for the activations and gradients: the peak
of the bytes allocated and not yet freed during one training step (forward, backward, optimizer step),
from the allocation events of PyTorch's profiler, counted from the start of the step (so the weights and
the optimizer state, which exist before it, are not in it). It is the CPU counterpart of CUDA's
``max_memory_allocated`` minus the memory in use before the step; glibc's retained free memory makes an
RSS peak larger by an amount that depends on the allocation history (measured: 1.1 GiB RSS growth for a
0.69 GiB allocation peak).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch
from megatron.core import parallel_state as ps
from torch.profiler import ProfilerActivity, profile

from setdiff_mega import backends, methods
from setdiff_mega.config import ConfigError
from setdiff_mega.data.batch import Batch
from setdiff_mega.diffusion import build_objective, inputs_for
from setdiff_mega.model import build_model
from setdiff_mega.parallel import initialize

from .flops import body_parameters, norm_parameters, processed_positions
from .step import autocast_context

GIB = 2 ** 30


@dataclass
class MemoryEstimate:
    parameters: int               # this rank's (largest stage)
    weights: float                # bytes
    gradients: float
    optimizer: float
    ema: float
    activations: float
    activations_no_recompute: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.ema + self.activations

    def table(self) -> list[tuple[str, float]]:
        return [("weights", self.weights), ("gradients", self.gradients), ("optimizer (AdamW)", self.optimizer),
                ("EMA", self.ema), ("activations", self.activations), ("total", self.total)]


def rank_parameters(mc, padded_vocab: int, tp: int, pp: int) -> int:
    """Parameters of the largest pipeline stage's rank (body split over PP, TP shards of everything)."""
    h, v = mc.hidden_size, padded_vocab
    body = body_parameters(mc) // pp
    embed = v * h
    head = (0 if mc.tie_embeddings and pp == 1 else v * h) + (v if mc.head_bias else 0)  # PP: a tied copy
    final_norm = norm_parameters(mc, h)
    stages = [embed + head + final_norm] if pp == 1 else [embed, head + final_norm]
    return (body + max(stages)) // tp


def _layer_activations(mc, b: int, T_loc: int, tp: int, a: int) -> float:
    k = 4 if mc.activation == "swiglu" else 2
    return b * T_loc * (6.5 * mc.hidden_size + (5 * mc.hidden_size + k * mc.ffn_size) / tp) * a


def activation_bytes(mc, objective: str, L: int, b: int, tp: int = 1, pp: int = 1, cp: int = 1,
                     padded_vocab: int = 0, precision: str = "fp32", recompute: bool = True,
                     micro_batches: int = 1, split: bool = False, pattern_block: int = 1, every_row: bool = False):
    """Activation bytes of one rank at the backward's peak (see the module docstring); ``recompute=False``
    ignores the config's recomputation; ``split=True`` returns (kept after the forward, recomputation
    workspace and other transient or resident buffers); ``pattern_block``: the block size of the
    objective's mask pattern (its options' ``pattern_block``); ``every_row``: its options read logits on every
    row (``every_row_logits``)."""
    T, N = processed_positions(objective, L, mc.shift_logits or every_row)
    streams = methods.get(objective).streams
    Ls = T // streams
    Ls_p = -(-Ls // (2 * cp)) * 2 * cp
    T_loc, N_loc = streams * Ls_p // cp, (N // Ls) * Ls_p // cp if Ls else 0
    a = 2 if precision == "bf16" else 4
    layers = mc.num_layers // pp
    per_layer = _layer_activations(mc, b, T_loc, tp, a)
    layer_input = b * T_loc * mc.hidden_size * a
    g, n = (mc.recompute_granularity, mc.recompute_num_layers) if recompute else (None, None)
    workspace = 0.0                      # a recomputed unit's activations, alive during its backward only
    if g == "full" and mc.recompute_method == "uniform":
        body, workspace = -(-layers // n) * layer_input, min(n, layers) * per_layer
    elif g == "full":     # block: the first n layers recomputed, after the others' activations are freed
        body = min(n, layers) * layer_input + max(layers - n, 0) * per_layer
        workspace = per_layer if n >= layers else 0.0
    else:
        body = layers * per_layer
    # [1, T_loc, T'] bool; none when the inputs carry only the pattern (CP) and the backend runs it natively
    mask = backends.get(mc.attention_backend).mask_bytes(T_loc, streams * Ls_p, methods.get(objective).pattern,
                                                        pattern_block, patterns_only=cp > 1)
    head = N_loc * b * (4 * padded_vocab + 8 * mc.hidden_size) + T_loc * b * 4 * mc.hidden_size
    kept = min(pp, micro_batches) * body + mask + head
    # the loss's backward, first in the backward (all activations still kept): about three fp32 [N, V] tensors
    # (the log-probabilities' gradient, the logits' gradient in the softmax and at the head; measured 2.2-2.8)
    workspace = max(workspace, 3 * N_loc * b * 4 * padded_vocab)
    return (kept, workspace) if split else kept + workspace


def measure_step_peak(step) -> int:
    """Peak bytes allocated (and not yet freed) during ``step()`` on the CPU, from the profiler's memory
    events in time order (see the module docstring). Run one step before, so the optimizer state exists."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def measure_config(cfg, vocab: int, seed: int = 0) -> int:
    """:func:`measure_step_peak` of one training step of ``cfg``'s model and objective on random tokens in
    this process (single-rank layouts; megatron-core's parallel state is initialised if it is not)."""
    if not ps.model_parallel_is_initialized():
        initialize(seed=seed)
    tc, o = cfg.train, cfg.objective
    model = build_model(cfg.model, vocab, precision=tc.precision).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    obj = build_objective(o.name, vocab - 1, options=o.options, shift_logits=cfg.model.shift_logits)
    b, L = tc.micro_batch_size, cfg.data.seq_length
    tokens = torch.randint(0, vocab - 1, (b, L), generator=torch.Generator().manual_seed(seed))
    inp = inputs_for(obj, Batch(tokens, list(range(b))), seed=seed)

    def step():
        with autocast_context(tc.precision):
            loss, _ = obj.loss(model(**inp.model_kwargs()), inp)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    return measure_step_peak(step)


def estimate(cfg, padded_vocab: int, world_size: int | None = None) -> MemoryEstimate:
    """Per-rank memory of a :class:`~setdiff_mega.config.RunConfig` (its layout; DP from ``world_size``)."""
    mc, tc, p = cfg.model, cfg.train, cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp = max(1, (world_size or tp * pp * cp) // (tp * pp * cp))
    n = rank_parameters(mc, padded_vocab, tp, pp)
    wb = 2 if tc.precision == "bf16" else 4
    zero = tc.zero_stage
    weights = n * wb / (dp if zero >= 3 else 1)
    grads = n * wb / (dp if zero >= 2 else 1)
    optim = n * 2 * wb / (dp if zero >= 1 else 1)
    ema = 4.0 * n if tc.ema_decay > 0 else 0.0
    args = (mc, cfg.objective.name, cfg.data.seq_length, tc.micro_batch_size, tp, pp, cp, padded_vocab, tc.precision)
    act = {r: activation_bytes(*args, recompute=r, micro_batches=tc.grad_accum_steps,
                               pattern_block=cfg.objective.options.pattern_block,
                               every_row=cfg.objective.options.every_row_logits) for r in (True, False)}
    return MemoryEstimate(parameters=n, weights=weights, gradients=grads, optimizer=optim, ema=ema,
                          activations=act[True], activations_no_recompute=act[False])


def available_bytes() -> tuple[float, str]:
    """(bytes a rank may use, what they are): free memory of this GPU, or this machine's available RAM
    shared by the ranks on it (``LOCAL_WORLD_SIZE``, set by torchrun)."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return float(free), "free on this GPU"
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    share = f" shared by {local} ranks" if local > 1 else ""
    return psutil.virtual_memory().available / local, f"of this machine's available memory{share}"


def check_memory(cfg, padded_vocab: int, world_size: int | None = None) -> None:
    """Refuse (ConfigError naming the fields) a run whose estimated memory per rank exceeds what the machine
    has: the kernel would kill it with no message (a long data.seq_length, say), after the set-up."""
    est = estimate(cfg, padded_vocab, world_size)
    have, what = available_bytes()
    if est.total <= have:
        return
    act = est.activations / GIB
    raise ConfigError(f"this run needs about {est.total / GIB:.1f} GiB per rank (activations {act:.1f} GiB at "
                      f"data.seq_length={cfg.data.seq_length}, train.micro_batch_size="
                      f"{cfg.train.micro_batch_size}; tools/estimate_memory.py shows the whole estimate), more than "
                      f"the {have / GIB:.1f} GiB {what}: lower data.seq_length or train.micro_batch_size, recompute "
                      f"activations (model.recompute_granularity), or split the work over more ranks "
                      f"(train.check_memory=false skips this check)")


__all__ = ["measure_step_peak", "measure_config", "MemoryEstimate", "estimate", "activation_bytes",
           "rank_parameters", "available_bytes", "check_memory", "GIB"]
