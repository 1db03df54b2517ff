"""Shape-stable decode steps and their capture as CUDA graphs (``GenerationConfig.static_shapes``).

A decode forward costs, at batch 1 on a small model, mostly the launch of its few hundred kernels. With
static shapes every step can be replayed from one captured CUDA graph instead. What makes a step static:

* the chunk: :class:`~setdiff_mega.decoding.runner.ChunkRunner` pads the pending and query rows to
  fixed widths (SetDLM: W and W) with invalid rows (they see only themselves, no row sees them, their
  K/V are never persisted), so tokens, positions and the keep-mask [B, 1, T, C + T] keep one shape;
* the cache: :class:`~setdiff_mega.decoding.cache.KVCache` with ``static=True`` keeps its window at
  offset 0 (evictions compact in place instead of moving the offset), so the attended view
  ``[window ; chunk]`` keeps its address;
* the host-side bookkeeping the attention does (reserving the chunk's scratch slots) runs before the
  forward (:meth:`KVCache.begin`), outside the captured region.

:class:`CapturedStep` keys every call by its *signature*: the shapes, dtypes and strides of the inputs,
``logits_start``, and the cache buffer's address and offset. On CUDA the first call of a signature runs a
few warm-up forwards on a side stream, captures one forward into a ``torch.cuda.CUDAGraph`` reading
persistent input buffers, and every later call copies its inputs into them and replays the graph (the
first replay of each graph is compared with the eager forward; a disagreement turns capture off with a
warning).
Elsewhere (CPU) it runs the forward eagerly and counts the signatures, which is what the CPU tests
check: after the prefill, a whole decode (evictions included) is one signature. The KV writes of a
replayed forward land in the cache's scratch region exactly as the eager ones do.
"""
from __future__ import annotations

import warnings
from collections import Counter

import torch


class CapturedStep:
    """``fn(tokens, position_ids, keep, logits_start)`` replayed from CUDA graphs per input signature."""

    def __init__(self, fn, enabled: bool = True, warmup: int = 2):
        self.fn, self.enabled, self.warmup = fn, enabled, warmup
        self.signatures: Counter = Counter()
        self.graphs: dict = {}

    @staticmethod
    def signature(tokens, position_ids, keep, logits_start: int, cache, key=None) -> tuple:
        """Shapes / dtypes / strides of the inputs, ``logits_start``, the cache buffers' addresses and offset,
        and ``key`` (the caller's identity of the weights a graph reads)."""
        sig = tuple((tuple(t.shape), t.dtype, t.stride(), str(t.device)) for t in (tokens, position_ids, keep))
        buf = None if cache is None else (cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape), cache.offset)
        return sig + (int(logits_start), buf, key)

    def __call__(self, tokens, position_ids, keep, logits_start: int = 0, cache=None, key=None):
        sig = self.signature(tokens, position_ids, keep, logits_start, cache, key)
        self.signatures[sig] += 1
        if not (self.enabled and tokens.is_cuda):
            return self.fn(tokens, position_ids, keep, logits_start)
        if cache is not None:
            cache.begin(tokens.shape[1])             # the host-side part of the cached attention
        graph, first = self.graphs.get(sig), sig not in self.graphs
        if first:
            graph = self.graphs[sig] = self._capture(tokens, position_ids, keep, logits_start)
        for buf, t in zip(graph["inputs"], (tokens, position_ids, keep)):
            buf.copy_(t)
        graph["graph"].replay()
        out = graph["out"].clone()
        if first:                     # a replay that disagrees with the eager forward costs speed, not tokens
            ref = self.fn(tokens, position_ids, keep, logits_start)
            if not torch.allclose(out.float(), ref.float(), rtol=1e-3, atol=1e-3):
                warnings.warn("static_shapes: the captured decode step disagrees with the eager one on this "
                              "device; decoding continues without CUDA graphs")
                self.enabled = False
                return ref
        return out

    def _capture(self, tokens, position_ids, keep, logits_start: int) -> dict:
        inputs = [t.clone() for t in (tokens, position_ids, keep)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                 # warm-up (library handles, workspaces) off the graph
            for _ in range(self.warmup):
                self.fn(*inputs, logits_start)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.fn(*inputs, logits_start)
        return {"graph": graph, "inputs": inputs, "out": out}

    def steady_signatures(self) -> int:
        """Distinct signatures seen more than once (the steady-state decode steps; a prefill is seen once)."""
        return sum(1 for n in self.signatures.values() if n > 1)


__all__ = ["CapturedStep"]
