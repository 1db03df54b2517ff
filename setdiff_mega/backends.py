"""The attention-backend registry: one record per core attention, the single place that knows each one.

A record holds what the rest of the stack asks about a backend, so no module outside this one compares
backend names (the layer spec, config validation, the memory estimate, the decoding engines and the
benchmarks all read the records):

    core            "module:Class" of its core attention (megatron-core's ``DotProductAttention``
                    signature), or None for the transformer implementation's own (mcore / TE)
    label           one line for tables and ``--help``
    native(kind, S) whether it runs a :class:`~setdiff_mega.diffusion.masks.MaskPattern` of that kind and
                    block size from the structure alone (no dense T x T mask)
    context_parallel  it gathers keys / values over the CP group (every ``SDPACoreAttention`` subclass)
    kv_cache        it decodes through the samplers' KV cache (``SetDiffusionTransformer.use_cache``)
    packed_documents  it keeps packed documents apart (``MaskPattern.documents``: the dense mask has them; a
                    structured kernel must read them): ``data.packing`` needs it
    cpu_backward    it can train on CPU (FlexAttention has no CPU backward)
    fp8             it runs under the FP8 linears (the linears are the spec's; attention stays bf16)
    kernel          "module:function" of its bare attention ``fn(q, k, v, pattern)``, for the kernel
                    micro-benchmark (None: none of its own)
    benchmark       it is one of the training benchmark's settings (``bench_label``: how it is named there)

and its memory term, :meth:`AttentionBackend.mask_bytes`: the bytes of the boolean mask rows a rank builds
(none when the pattern is native and the inputs carry only the pattern, which context parallelism does).

Adding a backend = one module with its core attention + one :func:`register` call (see "How to add an
attention backend" in ``docs/architecture.md``; ``tests/unit/test_registry.py`` registers a toy one). The
registry imports nothing heavy: the config validates names with it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


class BackendError(ValueError):
    """An unknown attention backend name (config validation names model.attention_backend)."""


def _import(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    core: str | None
    label: str
    native: Callable = lambda kind, block: False
    context_parallel: bool = True
    kv_cache: bool = True
    packed_documents: bool = True
    cpu_backward: bool = True
    fp8: bool = True
    kernel: str | None = None
    benchmark: bool = True
    bench_label: Callable = None                    # (kind, block) -> the benchmark's label (default: the name)

    def core_class(self):
        """The core attention module class (None: keep the transformer implementation's own)."""
        return None if self.core is None else _import(self.core)

    def kernel_function(self):
        """``fn(q, k, v, pattern)`` of the bare kernel (micro-benchmark), or None."""
        return None if self.kernel is None else _import(self.kernel)

    def bench_name(self, kind: str, block: int) -> str:
        """How the benchmark names this backend on a pattern (how it runs it, when that differs)."""
        return self.name if self.bench_label is None else self.bench_label(kind, block)

    def mask_bytes(self, rows: int, cols: int, kind: str, block: int, patterns_only: bool) -> int:
        """Bytes of the boolean mask a rank holds for ``rows`` queries x ``cols`` keys: none when the inputs
        carry only the pattern (context parallelism) and this backend runs it natively."""
        return 0 if patterns_only and self.native(kind, block) else rows * cols


_REGISTRY: dict[str, AttentionBackend] = {}


def register(backend: AttentionBackend) -> AttentionBackend:
    """Add (or replace) a backend; config validation, the layer spec and the estimates see it at once."""
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> AttentionBackend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BackendError(f"model.attention_backend={name!r} is not one of {', '.join(_REGISTRY)}") from None


def names() -> tuple:
    return tuple(_REGISTRY)


DEFAULT = "sdpa"
_M = "setdiff_mega.model."
SDPA = register(AttentionBackend(
    "sdpa", _M + "attention:SDPACoreAttention", "dense-mask reference (torch SDPA; causal masks run its causal "
    "kernel)", bench_label=lambda kind, block: "sdpa-causal" if kind == "causal" else "sdpa-dense-mask"))
FLEX = register(AttentionBackend(
    "flex", _M + "flex:FlexCoreAttention", "FlexAttention block mask from the pattern (compiled on GPU)",
    native=lambda kind, block: True, cpu_backward=False, kernel=_M + "flex:flex_attention"))
SETCAUSAL = register(AttentionBackend(
    "setcausal", _M + "setcausal:SetCausalCoreAttention", "mask-free set-causal decomposition (two causal "
    "kernels + LSE merge); SDPA for other masks", native=lambda kind, block: kind == "two_stream" and block == 1,
    kernel=_M + "setcausal:pattern_attention"))
LOCAL = register(AttentionBackend(
    "local", None, "the implementation's own (mcore DotProductAttention / TE), unfused", context_parallel=False,
    kv_cache=False, benchmark=False))


__all__ = ["AttentionBackend", "BackendError", "register", "unregister", "get", "names", "DEFAULT", "SDPA", "FLEX",
           "SETCAUSAL", "LOCAL"]
