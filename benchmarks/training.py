"""Training-step and attention benchmarks (``tools/bench_train_gpu.py``; a benchmark, not a test).

Train step: one optimizer step of a model built exactly as the trainer builds it (megatron-core layers
from the layer spec, fp32 master weights, bf16 autocast, AdamW), on random tokens, with the objective
building its inputs every step as in training (SetDLM samples its orders on the device). Per setting:

    step_s                 median wall time of a step (CUDA-synchronised), after warm-up (FlexAttention
                           and torch.compile finish compiling in the warm-up)
    processed_tok_s        B * T / step_s    (T = L - 1 for AR, 2L for SetDLM: positions the model runs)
    sample_tok_s           B * L / step_s    (tokens of training data consumed)
    model_tflops           flops_per_sample(...) * B / step_s (:mod:`.flops`: 6 T P_body + 6 N H V +
                           12 layers H T^2, attention counted dense over T x T)
    mfu                    model_tflops / dense bf16 peak (H100/H200: 989 TFLOP/s)
    mfu_dense_only         the same without the attention term (6 T P_body + head): a lower bound that
                           does not depend on how attention is counted

Every setting uses the same number of processed tokens per step (``tokens_per_step``), so AR runs twice
the samples of SetDLM. Attention: forward + backward time of set-causal attention over 2L positions by
each backend against two causal calls of length L (``F.scaled_dot_product_attention(is_causal=True)``,
the baseline measured in the same run), as a ratio.

A setting that cannot run here (FlexAttention training on CPU, FP8 without torchao) is reported with its
reason instead of numbers; the others still run.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from setdiff_mega import backends, methods
from setdiff_mega.config import ModelConfig
from setdiff_mega.data.batch import Batch
from setdiff_mega.diffusion import build_objective, inputs_for
from setdiff_mega.diffusion.ar import AR
from setdiff_mega.diffusion.masks import MaskPattern
from setdiff_mega.diffusion.setdlm import SETDLM
from setdiff_mega.model import build_model
from setdiff_mega.training.flops import flops_terms, peak_flops, processed_positions
from setdiff_mega.training.step import micro_batch_loss

PRESETS = {
    # GPT-2 medium shape: 24 x 1024, 16 heads, vocab 50304 -> 302M body + 51.5M embedding + 51.5M head
    "350m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, vocab=50304),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab=512),
}

def default_settings() -> list[tuple]:
    """(label, objective, attention backend, fp8) from the registries: AR on the default backend (the
    ceiling), SetDLM on every backend its record marks for the benchmark, and with torchao FP8 linears: AR,
    and SetDLM on the backends that run its pattern natively."""
    ar_backend = backends.get(backends.DEFAULT)
    ar = [(AR.name, ar_backend)]
    setdlm = [(SETDLM.name, backends.get(n)) for n in backends.names() if backends.get(n).benchmark]
    native = [(o, b) for o, b in setdlm if b.native(SETDLM.pattern, 1) and b.fp8]

    def label(objective, b, fp8):
        m = methods.get(objective)
        return f"{objective}/{b.bench_name(m.pattern, 1)}" + ("+fp8" if fp8 != "none" else "")
    return [(label(o, b, f), o, b.name, f) for group, f in ((ar + setdlm, "none"), (ar + native, "torchao"))
            for o, b in group]


DEFAULT_SETTINGS = default_settings()      # the registered backends at import


@dataclass
class StepResult:
    label: str
    objective: str
    backend: str
    fp8: str
    L: int
    batch: int
    processed_tokens: int
    step_s: float = math.nan
    step_s_std: float = math.nan
    processed_tok_s: float = math.nan
    sample_tok_s: float = math.nan
    model_tflops: float = math.nan
    mfu: float = math.nan
    mfu_dense_only: float = math.nan
    peak_mem_gib: float = math.nan
    loss: float = math.nan
    error: str = ""


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device, warmup: int, iters: int) -> list[float]:
    """Wall-clock seconds of ``iters`` calls of ``fn`` after ``warmup`` calls (synchronised)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def model_config(preset: str, **overrides):
    p = dict(PRESETS[preset])
    vocab = p.pop("vocab")
    mc = ModelConfig(**p, vocab_size=vocab, make_vocab_size_divisible_by=128, max_position_embeddings=8192,
                     zero_init_head=False)
    return dataclasses.replace(mc, **overrides)


def bench_train_step(label, objective_name, backend, fp8, L, preset="350m", tokens_per_step=32768,
                     warmup=3, iters=10, device=None, D=4) -> StepResult:
    """Time one training setting; errors become the row's ``error`` (the benchmark goes on)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mc = model_config(preset, attention_backend=backend, fp8=fp8, transformer_impl="local")
    obj = build_objective(objective_name, mask_id=mc.vocab_size - 1, D=D)
    T, _ = processed_positions(objective_name, L)
    B = max(1, tokens_per_step // T)
    row = StepResult(label, objective_name, backend, fp8, L, B, B * T)
    try:
        torch.manual_seed(0)
        model = build_model(mc, mc.vocab_size).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randint(0, mc.vocab_size - 1, (B, L), device=device, generator=gen)
        losses = []

        def step():
            inp = inputs_for(obj, Batch(x, list(range(B)), len(losses) * B), seed=len(losses))   # fresh noise
            loss, _ = micro_batch_loss(model, obj, inp, lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = time_fn(step, device, warmup, iters)
        row.step_s = statistics.median(times)
        row.step_s_std = statistics.pstdev(times)
        row.processed_tok_s = B * T / row.step_s
        row.sample_tok_s = B * L / row.step_s
        terms = flops_terms(mc, model.padded_vocab_size, objective_name, L)
        flops, attn = sum(terms.values()) * B, terms["attention"] * B
        row.model_tflops = flops / row.step_s / 1e12
        peak = peak_flops()
        if peak:
            row.mfu = flops / row.step_s / peak
            row.mfu_dense_only = (flops - attn) / row.step_s / peak
        if device.type == "cuda":
            row.peak_mem_gib = torch.cuda.max_memory_allocated(device) / 2 ** 30
        row.loss = float(losses[-1])
    except Exception as e:              # noqa: BLE001 - a benchmark row reports why it could not run
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


@dataclass
class AttentionResult:
    L: int
    backend: str
    fwd_bwd_ms: float = math.nan
    ratio_vs_two_causal: float = math.nan
    error: str = ""


def kernel_backends() -> tuple:
    """The registered backends with a bare kernel of their own (the attention micro-benchmark's rows)."""
    return tuple(n for n in backends.names() if backends.get(n).kernel is not None)


def bench_attention(L, batch, heads=16, head_dim=64, warmup=3, iters=20, device=None,
                    names=None) -> list[AttentionResult]:
    """Forward + backward of set-causal attention over 2L positions vs two causal calls of length L (the
    baseline), each registered backend's kernel, and SDPA with the dense 2L x 2L mask; ``names``: a subset."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, 2 * L, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    pattern = MaskPattern("two_stream", 2 * L)
    names = names or ("two_causal", *kernel_backends(), "sdpa_dense_mask")
    keep = pattern.dense(device)[:, None] if "sdpa_dense_mask" in names else None

    def two_causal():
        h = [F.scaled_dot_product_attention(t[0], t[1], t[2], is_causal=True)
             for t in ((q[:, :, :L], k[:, :, :L], v[:, :, :L]), (q[:, :, L:], k[:, :, L:], v[:, :, L:]))]
        torch.autograd.backward(h, [dout[:, :, :L], dout[:, :, L:]])

    def kernel(name):
        fn = backends.get(name).kernel_function()
        return lambda: fn(q, k, v, pattern).backward(dout)

    fns = {"two_causal": two_causal,
           "sdpa_dense_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep).backward(dout)}
    rows, base = [], None
    for name in names:
        row = AttentionResult(L, name)
        try:
            t = statistics.median(time_fn(fns.get(name) or kernel(name), device, warmup, iters))
            row.fwd_bwd_ms = t * 1e3
            if name == "two_causal":
                base = t
            if base:
                row.ratio_vs_two_causal = t / base
        except Exception as e:          # noqa: BLE001
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        q.grad = k.grad = v.grad = None
        rows.append(row)
    return rows


def plot_mfu(rows: list[StepResult], path) -> None:
    """Bar chart of MFU (or processed tokens/s where no peak is known) per setting and length."""
    import matplotlib  # gated: the backend is chosen before pyplot is imported (headless machines)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.error]
    if not ok:
        return
    use_mfu = all(not math.isnan(r.mfu) for r in ok)
    lengths = sorted({r.L for r in ok})
    labels = list(dict.fromkeys(r.label for r in ok))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels) * len(lengths)), 4))
    width = 0.8 / len(lengths)
    for i, L in enumerate(lengths):
        vals = [next((100 * r.mfu if use_mfu else r.processed_tok_s for r in ok if r.label == lab and r.L == L),
                     0.0) for lab in labels]
        ax.bar([j + i * width for j in range(len(labels))], vals, width, label=f"L={L}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel("MFU (%)" if use_mfu else "processed tokens/s")
    ax.set_title("training step throughput per setting")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["PRESETS", "DEFAULT_SETTINGS", "default_settings", "kernel_backends", "StepResult", "AttentionResult",
           "bench_train_step", "bench_attention", "plot_mfu", "time_fn", "model_config"]
