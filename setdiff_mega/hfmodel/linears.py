"""How a decode forward's matrix products read their weights: ``DecodeModel(decode_weights=...)``.

Batch-1 decoding multiplies a handful of rows x [T, H] (T = pending + query rows, about 2W) by every weight
matrix once per step, so a forward's cost is reading the matrices (bytes) and how well the kernel uses the
few rows it has, not arithmetic. Each product is ``y = x W^T + b`` with x [.., K] float32, W [N, K], b [N],
y [.., N] float32 in every format; what differs is what is read and which kernel reads it:

    fp32         F.linear over the fused float32 matrices: bit-identical to the model's own forward
    fp32-packed  the same float32 matrices packed once in panels of 32 output columns for the small-M kernel
                 of :mod:`.cpu_kernels` (one sequential stream of each matrix, up to 12 rows per pass:
                 at T ~ 9 on an AVX-512 CPU about 1.3x oneDNN's prepacked linear and 2.5x MKL's sgemm), or,
                 where that kernel cannot be built, reordered into oneDNN's blocked layout (the prepacked
                 linear torch.compile's CPU freezing uses); the decode chunk's attention over the float32
                 cache by the same library's kernel. Products agree with fp32 to ~1e-6 relative (another
                 summation order), and every row's result is independent of the other rows (batching never
                 changes a row's tokens)
    bf16         bfloat16 matrices (half the bytes), the activations cast to bfloat16 at each product's input,
                 float32 accumulation inside the kernel, the product (rounded to bfloat16 by the kernel) and
                 the bias added in float32; oneDNN-prepacked on CPU. The KV cache is bfloat16 too (half the
                 bytes attention reads; queries cast to it, float32 accumulation inside SDPA); the residual
                 stream, norms, the logits and the samplers' softmax stay float32
    int8         weight-only int8 with one scale per output row through torchao's ``Int8WeightOnlyConfig``
                 (bf16 activations; torchao installed), otherwise as bf16 (bfloat16 KV cache)

Formats other than fp32 are CPU / CUDA options for speed with a stated tolerance (tests pin it); fp32 is the
one the exactness tests hold to (bit-identical to megatron-core). Packing needs oneDNN (x86 CPUs with torch's
mkldnn build) or the kernels of :mod:`.cpu_kernels`: elsewhere the packed formats run F.linear on the same matrices.

The default everywhere (the ``--decode-weights`` flags, ``decoding_model``, an export's ``generate``) is ``auto``,
resolved by :func:`resolve` against the device and dtype of the model's weights: fp32-packed for float32 weights on
a CPU where packing is usable (its greedy tokens equal fp32's on the pinned golden tests,
tests/inference/test_decode_weights.py; faster there), fp32 otherwise (a GPU decodes on the exact path; bf16 / int8
only on request). ``fp32`` named explicitly is the megatron-core-exact path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_kernels import library

FORMATS = ("fp32", "fp32-packed", "bf16", "int8")
AUTO = "auto"
CHOICES = (AUTO, *FORMATS)            # what a caller may name: a format, or auto (:func:`resolve`)


def check(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"decode_weights={fmt!r} is unknown; choose one of {', '.join(FORMATS)}")
    return fmt


def check_choice(fmt: str) -> str:
    """``fmt`` if it is a format or auto, else one line naming the choices."""
    if fmt not in CHOICES:
        raise ValueError(f"decode_weights={fmt!r} is unknown; choose one of {', '.join(CHOICES)}")
    return fmt


def resolve(fmt: str, device=None, dtype: torch.dtype = torch.float32) -> str:
    """The format ``fmt`` names for a model on ``device`` (None: where this process's models are built, a visible
    CUDA GPU, else the CPU) whose weights are ``dtype``: auto is fp32-packed for float32 weights on a CPU where
    packing is usable (:func:`packing_usable`), else fp32 (the model's own dtype, e.g. a bfloat16 export's); a
    format is itself."""
    if check_choice(fmt) != AUTO:
        return fmt
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return "fp32-packed" if kind == "cpu" and dtype == torch.float32 and packing_usable() else "fp32"


def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packing_usable() -> bool:
    """Whether fp32-packed packs anything on this CPU: the kernels of :mod:`.cpu_kernels` (built on first use) or,
    where they cannot be built (one warning), oneDNN's prepacked linear."""
    return library() is not None or _onednn()


def cache_dtype(fmt: str):
    """The KV cache's dtype a format asks for (bfloat16 for bf16 / int8), None: the model's."""
    return torch.bfloat16 if check(fmt) in ("bf16", "int8") else None


def _can_pack(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and _onednn()


class Product:
    """One matrix product ``x -> x W^T + b`` in a format (see the module docstring). ``rows`` is the expected
    number of rows per call (oneDNN's packing hint; any count works). ``nbytes`` is what a call reads of W."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str = "fp32", rows: int = 16):
        self.fmt, self.bias = check(fmt), bias
        self.out_features = weight.shape[0]
        self.packed, self.panels = False, None
        if fmt == "fp32":
            self.w = weight
        elif fmt == "int8":
            self.w = _int8(weight)
        elif fmt == "fp32-packed" and weight.device.type == "cpu" and (kernels := library()) is not None:
            self.panels, self.w = kernels, kernels.pack(weight)
        else:
            w = weight.detach().to(torch.bfloat16 if fmt == "bf16" else weight.dtype).contiguous()
            self.packed = _can_pack(w)
            self.w = torch.ops.mkldnn._reorder_linear_weight(w, rows) if self.packed else w
        self.nbytes = weight.numel() * {"fp32": weight.element_size(), "fp32-packed": weight.element_size(),
                                        "bf16": 2, "int8": 1}[fmt] + (0 if bias is None else bias.numel() * 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "fp32":
            return F.linear(x, self.w, self.bias)
        if self.panels is not None:
            y = self.panels.linear(x, self.w, self.out_features)
            return y if self.bias is None else y.add_(self.bias)
        low = x if self.fmt == "fp32-packed" else x.to(torch.bfloat16)
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(low, self.w, None, "none", [], "")
        else:
            y = F.linear(low, self.w)
        y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)


def _int8(weight: torch.Tensor):
    """torchao's weight-only int8 tensor of ``weight`` (per-row scales), applied to a bf16 linear."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ValueError("decode_weights='int8' needs torchao (pip install torchao); or use bf16") from None
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(weight)
    quantize_(lin, Int8WeightOnlyConfig())
    return lin.weight


__all__ = ["AUTO", "CHOICES", "FORMATS", "Product", "cache_dtype", "check", "check_choice", "packing_usable",
           "resolve"]
