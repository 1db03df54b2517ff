"""One decode forward measured against the machine's memory bandwidth: ms per forward, bytes read, the floor.

A batch-1 decode step of SetDLM at tau >= 1 runs one chunk of T = 1 + W rows (the last step's commit and the W
window queries) through every layer against a KV cache of C committed tokens, and the head on the W query
rows. What it must read at least, in bytes:

    weights   every product's matrix once (:meth:`~setdiff_mega.hfmodel.decode_step.Prepared.nbytes`: the
              layers' fused q/k/v, o, up, down and the head, in the decode-weights format)
    cache     layers x 2 (K, V) x groups x (C + T) x head_dim x 4 (2 in bfloat16: the bf16 / int8 formats
              cache), read by attention (the chunk's T entries written)
    logits    W x V x 4 written

The floor is those bytes over the bandwidth of a stream copy measured in the same run (:func:`stream_bandwidth`:
``dst.copy_(src)`` of 256 MiB, read + written bytes over the best time, one thread); ``floor_ratio`` = ms per
forward / floor ms (1 = at the floor). Shapes (random weights: speed does not depend on their values):

    main     the main job's model (configs/tiny_cpu.yaml: 4 layers, hidden 160, L = 128, vocabulary 2048), W = 4
    gpt2     GPT-2-small's shape (12 layers, hidden 768, 12 heads, L = 1024, vocabulary 50257), W = 8

:func:`forward_case` times the plain forward (every decode-weights format) and the megatron-core model's
forward on the same weights and chunk, interleaved per repeat (median); :func:`profile_forward` splits one
plain forward by operator and by part (products, attention, head, the rest) with torch.profiler.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from setdiff_mega.config.loading import load_config
from setdiff_mega.decoding.cache import KVCache
from setdiff_mega.hfmodel.cpu_kernels import ATTENTION_LABEL, LINEAR_LABEL
from setdiff_mega.hfmodel.decode_step import Prepared
from setdiff_mega.hfmodel.linears import FORMATS
from setdiff_mega.model import build_model
from setdiff_mega.parallel.state import initialize

from .engine import plain_model


@dataclass(frozen=True)
class Shape:
    name: str
    overrides: tuple
    vocab: int
    window: int


SHAPES = {
    "main": Shape("main", (), 2048, 4),
    "gpt2": Shape("gpt2", ("model.num_layers=12", "model.hidden_size=768", "model.num_attention_heads=12",
                           "data.seq_length=1024"), 50257, 8),
}


def stream_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """GB/s of ``dst.copy_(src)`` over ``mib`` MiB (bytes read + written, best of ``repeats``)."""
    src = torch.randn(mib * 2 ** 18)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def build_models(shape: Shape, config: str = "configs/tiny_cpu.yaml", seed: int = 0) -> tuple:
    """(native megatron-core model, RunConfig, tokenizer stand-in) of ``shape`` with random weights."""
    cfg = load_config(config, list(shape.overrides))
    initialize(seed=seed)                     # one process (no-op when parallel state exists)
    mc = replace(cfg.model, zero_init_head=False, attention_backend="sdpa")
    cfg = replace(cfg, model=mc)
    torch.manual_seed(seed)
    native = build_model(mc, shape.vocab).eval()
    v = shape.vocab
    tok = SimpleNamespace(vocab_size=v, bos=v - 4, eos=v - 3, pad=v - 2, mask=v - 1)
    return native, cfg, tok


class Chunk:
    """The tau >= 1 decode step's inputs: a cache of C = L - T - 8 committed entries, T = 1 + W chunk rows; one
    cache per dtype a model asks for (``cache_dtype``: bf16 formats), the same random entries in each."""

    def __init__(self, model, L: int, W: int, vocab: int, seed: int = 0):
        layers, groups, d = model.cache_shape()
        self.T, self.W = 1 + W, W
        C = L - self.T - 8
        self.cache = KVCache(layers, 1, groups, d, C)
        g = torch.Generator().manual_seed(seed)
        self.cache.k.normal_(generator=g)
        self.cache.v.normal_(generator=g)
        self.cache.length.fill_(C)
        self.caches = {torch.float32: self.cache}
        self.tokens = torch.randint(0, vocab - 8, (1, self.T), generator=g)
        self.positions = torch.arange(C, C + self.T)[None]
        self.keep = torch.ones(1, self.T, C + self.T, dtype=torch.bool)
        self.kv_elements = layers * 2 * groups * (C + self.T) * d
        self.logit_bytes = W * vocab * 4

    def cache_for(self, model) -> KVCache:
        dtype = getattr(model, "cache_dtype", None) or torch.float32
        if dtype not in self.caches:
            c = self.cache
            cache = KVCache(c.num_layers, 1, c.k.shape[2], c.k.shape[4], c.capacity, dtype=dtype)
            cache.k.copy_(c.k)
            cache.v.copy_(c.v)
            cache.length.copy_(c.length)
            self.caches[dtype] = cache
        return self.caches[dtype]

    def kv_bytes(self, model) -> int:
        return self.kv_elements * self.cache_for(model).k.element_size()

    def run(self, model):
        cache = self.cache_for(model)
        with model.use_cache(cache):
            out = model(self.tokens, self.positions, self.keep, 1)
        cache.discard()
        return out


def forward_case(shape: Shape, formats=FORMATS, repeats: int = 5, forwards: int = 10, native: bool = True,
                 bandwidth: float | None = None) -> dict:
    """ms per forward of every plain format (and the megatron-core forward) on ``shape``, interleaved; bytes
    and the floor per format (module docstring)."""
    model, cfg, tok = build_models(shape)
    L = cfg.data.seq_length
    runners = {f"plain-{f}": plain_model(model, cfg, tok, f) for f in formats}
    if native:
        runners["megatron-core"] = model
    chunk = Chunk(model, L, shape.window, shape.vocab)
    ref = chunk.run(runners[f"plain-{formats[0]}"])
    times, errs = {n: [] for n in runners}, {}
    with torch.no_grad():
        for r in range(max(repeats, 1) + 1):                          # the first round warms up
            for n in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
                t0 = time.perf_counter()
                for _ in range(forwards):
                    out = chunk.run(runners[n])
                if r:
                    times[n].append(1e3 * (time.perf_counter() - t0) / forwards)
                else:
                    errs[n] = float((out - ref).abs().max() / ref.abs().max())
    bw = bandwidth or stream_bandwidth()
    rows = []
    fp32_bytes = Prepared(runners[f"plain-{formats[0]}"].model).nbytes()      # megatron-core reads fp32
    for n, m in runners.items():
        wbytes = m.weights().nbytes() if hasattr(m, "weights") else fp32_bytes
        total = wbytes + chunk.kv_bytes(m) + chunk.logit_bytes
        ms = statistics.median(times[n])
        floor = 1e3 * total / (bw * 1e9)
        rows.append({"engine": n, "ms_per_forward": ms, "bytes": total, "weight_bytes": wbytes,
                     "floor_ms": floor, "floor_ratio": ms / floor, "logits_rel_err": errs[n]})
    return {"shape": shape.name, "parameters": sum(p.numel() for p in model.parameters()),
            "chunk_rows": chunk.T, "cache_entries": chunk.cache.capacity, "window": shape.window,
            "bandwidth_gb_s": bw, "threads": torch.get_num_threads(), "repeats": repeats, "forwards": forwards,
            "rows": rows}


PARTS = (("products", ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::_weight_int8pack_mm",
                       LINEAR_LABEL)),
         ("attention", ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                        "aten::bmm", "aten::baddbmm", "aten::_softmax", ATTENTION_LABEL)),
         ("cache writes and copies", ("aten::copy_", "aten::index_put_", "aten::scatter_")))


def profile_forward(runner, chunk: Chunk, forwards: int = 5, top: int = 15) -> dict:
    """One engine's forward split by operator (self CPU ms per forward, the ``top`` largest), by part
    (:data:`PARTS`; the rest is "other") and, for the plain forward, by layer and the head (its labels)."""
    from torch.profiler import ProfilerActivity, profile

    chunk.run(runner)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(forwards):
            chunk.run(runner)
    events = prof.key_averages()
    ops = sorted(((e.key, e.self_cpu_time_total / 1e3 / forwards, e.count // forwards) for e in events
                  if not e.key.startswith("decode ")), key=lambda x: -x[1])
    total = sum(ms for _, ms, _ in ops)
    parts = {name: sum(ms for k, ms, _ in ops if k in keys) for name, keys in PARTS}
    parts["other"] = total - sum(parts.values())
    labelled = {e.key: e.cpu_time_total / 1e3 / forwards for e in events if e.key.startswith("decode ")}
    layers = [labelled[k] for k in sorted((k for k in labelled if k.startswith("decode layer")),
                                          key=lambda k: int(k.rsplit(" ", 1)[1]))]
    return {"ms_per_forward": total, "by_part": parts, "by_layer_ms": layers, "head_ms": labelled.get("decode head"),
            "by_operator": [{"op": k, "ms": ms, "calls": c} for k, ms, c in ops[:top]]}


def plot(report: dict, path) -> None:
    """Bars: ms per forward of every engine / format per shape, with each one's bandwidth floor marked."""
    import matplotlib  # gated: the backend is chosen before pyplot is imported (headless machines)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = report["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), dpi=120, squeeze=False)
    for ax, case in zip(axes[0], shapes):
        rows = case["rows"]
        x = range(len(rows))
        ax.bar(x, [r["ms_per_forward"] for r in rows], color="tab:blue", label="measured")
        ax.scatter(x, [r["floor_ms"] for r in rows], color="black", marker="_", s=400, zorder=3,
                   label="bandwidth floor")
        ax.set_xticks(list(x), [r["engine"].replace("plain-", "") for r in rows], rotation=30, fontsize=8)
        ax.set_ylabel("ms per decode forward (batch 1)")
        ax.set_title(f"{case['shape']}: {case['parameters'] / 1e6:.1f}M parameters, {case['chunk_rows']} rows, "
                     f"{case['cache_entries']} cached", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"One decode forward against the memory bandwidth ({report['bandwidth_gb_s']:.1f} GB/s copy)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


__all__ = ["plot", "SHAPES", "Shape", "Chunk", "build_models", "forward_case", "profile_forward", "stream_bandwidth"]
