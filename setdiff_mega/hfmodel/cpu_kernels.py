"""Small CPU kernels for batch-1 decoding in float32: the chunk's attention over the cache and its products.

A decode forward runs a chunk of T ~ W + 1 rows (T <= 16) through every layer. PyTorch's CPU kernels for its
two shapes are slow on this: MKL's sgemm multiplies a T x d block by a d x N one at ~20 GFLOP/s where its
large products reach ~70 (SDPA's flash kernel and ``bmm`` both land there: at GPT-2-small shape the
attention over a 1,007-entry cache took 15 ms, four times the time to read the cache), and oneDNN's
prepacked linear reads a weight at ~13 GB/s whether M is 1 or 9, half of what a plain sum streams
(docs/results.md, issue 44). Two kernels (source and loop structure: :mod:`.cpu_kernels_src`):

  attention   per (batch b, head h; g = h // (H / G) its KV group), queries q [T, d], keys / values K, V [N, d],
              the additive mask M [T, N]; the queries sit in the 16 vector lanes, so every key is read once:
                Q^T [d, 16]  = scale * q^T (lanes t >= T zero);  S^T[s] = M^T[s] + sum_i K[s, i] Q^T[i]
                m = max_s S^T[s], P^T[s] = exp(S^T[s] - m), l = sum_s P^T[s]   (per lane; every key masked:
                m = 0, P = 0, the output 0)
                out[t, i] = sum_s V[s, i] P^T[s][t] / l[t]
              layouts: q / out [B, H, T, d], K / V [B, G, N, d] (any strides with the channel contiguous, e.g.
              a view of the cache's buffer), mask [B, 1|H, T, N] float32 0 / -inf (or bool, turned into it).
              Equal to SDPA up to float32 rounding (another summation order; exp by a degree-6 polynomial
              after range reduction, ~2 ulp; a score more than 87.3 below its lane's maximum weighs 0).
  linear      y [M, N] = x [M, K] W^T over W packed once as panels [ceil(N / 32), K, 32] (column c of panel p
              = row 32 p + c of W, zero past N): one sequential pass over the matrix per 12 rows of x, each
              output one running sum over k (every row's result independent of the other rows).

Built on first use with the machine's C++ compiler (``g++ -O3 -march=native -fopenmp``, about a second) into
a cache directory (``SETDIFF_KERNEL_DIR``, else ``~/.cache/setdiff_mega/kernels``) under a name keyed by the
source, the flags, the compiler's version and the CPU's flags, written under a temporary name then linked into
place (only where no library of that key is: another process's build is never replaced);
loaded with ctypes (no torch headers, nothing else to install). Without a compiler, or when the build
fails, :func:`library` returns None after one warning and the ``fp32-packed`` decode-weights format that uses
them (:mod:`.linears`, :mod:`.decode_step`) falls back to oneDNN's prepacked linear and SDPA. The exported
model carries these files like every other module of ``hfmodel``.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .cpu_kernels_src import SOURCE

log = logging.getLogger(__name__)

MAX_QUERIES = 16                      # queries per head in the vector lanes (T <= 16)
PANEL = 32                            # output columns per packed panel of the small-M linear
ATTENTION_LABEL, LINEAR_LABEL = "setdiff::decode_attention", "setdiff::linear_panels"


FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build() -> Path:
    """The shared library's path, compiled now unless a build of the same key is already there."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([SOURCE, " ".join(FLAGS), version, _cpu_flags()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("SETDIFF_KERNEL_DIR") or Path.home() / ".cache" / "setdiff_mega" / "kernels")
    lib = root / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        src, out = Path(tmp) / "cpu_kernels.cpp", Path(tmp) / "cpu_kernels.so"
        src.write_text(SOURCE)
        done = subprocess.run([cxx, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        try:                                         # a whole library appears at once, and only where none is:
            os.link(out, lib)                        # a concurrent build's library is never replaced
        except FileExistsError:
            pass
    return lib


class Library:
    """The loaded library: :meth:`attention` (decode attention) and :meth:`pack` / :meth:`linear` (small-M
    products over a weight packed in panels of :data:`PANEL` output columns); see the module docstring."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._attention = self.lib.sdm_decode_attention
        self._attention.argtypes = ([ptr, i64, i64, i64] * 3 + [ptr, i64, i64, i64, i64, ptr, i64, i64, i64]
                                    + [i32] * 6 + [ctypes.c_float, i32])
        self._attention.restype = i32
        self._linear = self.lib.sdm_linear_panels
        self._linear.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i32]
        self._linear.restype = i32

    def attention(self, q, K, V, mask=None, scale=None):
        """q [B, H, T, d], K / V [B, G, N, d], mask [B, 1|H, T, N] additive float32 or bool (True: attend) ->
        out [B, H, T, d]; None where it does not apply (not float32 on CPU, T > 16)."""
        B, H, T, d = q.shape
        N = K.shape[2]
        if T > MAX_QUERIES or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (q, K, V)):
            return None
        if mask is not None:
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
            elif mask.dtype != torch.float32:
                return None
            mask = mask.expand(B, mask.shape[1], T, N)
        q, K, V = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, K, V))
        out = torch.empty(B, H, T, d, dtype=q.dtype)
        with _label(ATTENTION_LABEL):
            ms = (0, 0, 0, 0) if mask is None else (mask.stride(0), 0 if mask.shape[1] == 1 else mask.stride(1),
                                                     mask.stride(2), mask.stride(3))
            rc = self._attention(q.data_ptr(), *q.stride()[:3], K.data_ptr(), *K.stride()[:3], V.data_ptr(),
                                 *V.stride()[:3], None if mask is None else mask.data_ptr(), *ms, out.data_ptr(),
                                 *out.stride()[:3], B, H, K.shape[1], T, N, d,
                                 float(d ** -0.5 if scale is None else scale), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"decode attention kernel failed (code {rc}: q {tuple(q.shape)}, K {tuple(K.shape)})")
        return out

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """W [N, K] float32 -> panels [ceil(N / 32), K, 32] (zero columns past N), contiguous."""
        n, k = weight.shape
        p = -(-n // PANEL)
        padded = torch.zeros(p * PANEL, k, dtype=torch.float32)
        padded[:n] = weight.detach().to(torch.float32)
        return padded.view(p, PANEL, k).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
        """x [.., K] float32 -> x W^T [.., n] (no bias) for ``panels`` = :meth:`pack` (W)."""
        k = panels.shape[1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1 or x2.dtype != torch.float32:
            x2 = x2.contiguous().to(torch.float32)
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        if x2.shape[0]:
            with _label(LINEAR_LABEL):
                rc = self._linear(x2.data_ptr(), x2.stride(0), panels.data_ptr(), y.data_ptr(), n, x2.shape[0], n, k,
                                  torch.get_num_threads())
            if rc != 0:
                raise RuntimeError(f"small-M linear kernel failed (code {rc}: x {tuple(x2.shape)}, W [{n}, {k}])")
        return y.view(*x.shape[:-1], n)


def _label(name: str):
    """A profiler range of its own while torch.profiler records (the kernels are not torch operators)."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else _NULL


_NULL = contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def library() -> Library | None:
    """The kernels, built and loaded once per process (None, after one warning, where they cannot be built)."""
    try:
        return Library(_build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("CPU decode kernels unavailable (%s); fp32-packed uses oneDNN's linear and SDPA", err)
        return None


__all__ = ["ATTENTION_LABEL", "LINEAR_LABEL", "Library", "MAX_QUERIES", "PANEL", "library"]
