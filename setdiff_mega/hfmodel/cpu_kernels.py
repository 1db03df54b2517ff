"""Small CPU kernels for batch-1 decoding in float32: the chunk's attention over the cache and its products.

A decode forward runs a chunk of T ~ W + 1 rows (T <= 16) through every layer. PyTorch's CPU kernels for its
two shapes are slow on this: MKL's sgemm multiplies a T x d block by a d x N one at ~20 GFLOP/s where its
large products reach ~70 (SDPA's flash kernel and ``bmm`` both land there: at GPT-2-small shape the
attention over a 1,007-entry cache took 15 ms, four times the time to read the cache), and oneDNN's
prepacked linear reads a weight at ~13 GB/s whether M is 1 or 9, half of what a plain sum streams
(docs/results.md, issue 44). Two kernels (source and loop structure: ``cpu_kernels.cpp``):

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

The source is ``cpu_kernels.cpp`` beside this module (installed with the package, copied into every export;
transformers copies an export's ``.py`` modules elsewhere, so its ``from_pretrained`` names the export's copy:
:func:`use_source`). Its functions' C signatures are declared once here, in :data:`SIGNATURES`: the ctypes
argument types are built from it, and the library's ``sdm_signature()`` (which the compiler derives from the
functions' real parameter types) must equal it at load, else the library is refused with one line.

Built on first use with the machine's C++ compiler (``$CXX``, else ``g++`` / ``c++`` on PATH;
``-O3 -march=native -fopenmp``, a few seconds) into a private cache directory (``SETDIFF_KERNEL_DIR``, else
``~/.cache/setdiff_mega/kernels``; created 0700, refused when another user owns it or others can write it),
one entry ``cpu_kernels-<key>/`` per key (the source, the flags, the compiler's version and the CPU's flags)
holding the library and its SHA-256 (``cpu_kernels.so.sha256``). An entry is built in a private staging
directory and renamed into place whole, only where none of its key is (another process's build is never
replaced). Before it is loaded (loading runs a library's code), the library is opened without following links
and must be a regular file owned by this user, writable by no one else, in an entry of the same kind, with
the SHA-256 recorded beside it (then ctypes loads it: only this user can change it in between). A cached
entry that fails this is reported on one line, removed and rebuilt. Without a compiler, or when the build or
the checks fail, :func:`library` returns None after one warning and the ``fp32-packed`` decode-weights format
that uses them (:mod:`.linears`, :mod:`.decode_step`) falls back to oneDNN's prepacked linear and SDPA;
:func:`load` raises the reason instead.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAX_QUERIES = 16                      # queries per head in the vector lanes (T <= 16)
PANEL = 32                            # output columns per packed panel of the small-M linear
ATTENTION_LABEL, LINEAR_LABEL = "setdiff::decode_attention", "setdiff::linear_panels"

SOURCE_NAME = "cpu_kernels.cpp"
LIBRARY_NAME, HASH_NAME = "cpu_kernels.so", "cpu_kernels.so.sha256"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

# The one declaration of the kernels' C signatures: ``result(name:type ...)`` with the C parameter names; only the
# types count (ptr: a pointer, i64: int64_t, i32: int, f32: float). The ctypes argtypes / restype are built from
# it, and it must equal the library's own sdm_signature() at load.
SIGNATURES = {
    "sdm_decode_attention": "i32(q:ptr qb:i64 qh:i64 qt:i64  k:ptr kb:i64 kg:i64 kn:i64  v:ptr vb:i64 vg:i64 vn:i64  "
                            "m:ptr mb:i64 mh:i64 mt:i64 mn:i64  o:ptr ob:i64 oh:i64 ot:i64  "
                            "B:i32 H:i32 G:i32 T:i32 N:i32 D:i32 scale:f32 threads:i32)",
    "sdm_linear_panels": "i32(x:ptr ldx:i64 wp:ptr y:ptr ldy:i64 M:i64 N:i64 K:i64 threads:i32)",
}
CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float}


class KernelError(RuntimeError):
    """The kernels cannot be used here (no compiler, no source, a failed build, a refused library); one line
    but for a compiler's own output."""


def _parse(declaration: str) -> tuple:
    """``"i32(a:ptr b:i64)"`` -> ("i32", ["ptr", "i64"])."""
    m = re.fullmatch(r"\s*(\w+)\s*\((.*)\)\s*", declaration, flags=re.S)
    if m is None:
        raise ValueError(f"not a kernel declaration: {declaration!r}")
    types = [p.partition(":")[2] for p in m.group(2).split()]
    bad = [t for t in [m.group(1), *types] if t not in CTYPES]
    if bad:
        raise ValueError(f"kernel declaration {declaration!r}: unknown types {bad} (known: {', '.join(CTYPES)})")
    return m.group(1), types


def declared_signature(signatures: dict | None = None) -> str:
    """The string a matching library's ``sdm_signature()`` returns: ``name(t,t,..)->r`` joined by ``;``."""
    out = []
    for name, declaration in (SIGNATURES if signatures is None else signatures).items():
        result, types = _parse(declaration)
        out.append(f"{name}({','.join(types)})->{result}")
    return ";".join(out)


_source_file: Path | None = None          # an export's copy of the source (use_source), where none is beside us


def use_source(path) -> None:
    """Compile ``path`` (an export's ``cpu_kernels.cpp``) where no source is beside this module: transformers
    copies an export's modules, not its other files, into its modules cache. None: nothing changes."""
    global _source_file
    if path is None or (_source_file is not None and Path(path) == _source_file):
        return
    _source_file = Path(path)
    library.cache_clear()


def source_path() -> Path:
    here = Path(__file__).with_name(SOURCE_NAME)
    if here.is_file():
        return here
    if _source_file is not None and _source_file.is_file():
        return _source_file
    raise KernelError(f"{SOURCE_NAME} is neither beside {Path(__file__).name} nor in the export this model was "
                      f"loaded from (copied without it?)")


def _source() -> str:
    return source_path().read_text()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    """The C++ compiler's path: ``$CXX`` where set (None when it is not found), else g++ or c++ on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def _me() -> int:
    return os.geteuid()


def _loose(st: os.stat_result, what: str) -> str | None:
    """Why a file or directory of the cache is not this user's alone (None: it is)."""
    if st.st_uid != _me():
        return f"{what} is owned by uid {st.st_uid}, not this user (uid {_me()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _root() -> Path:
    """The cache directory: created 0700; refused when another user owns it or others can write it."""
    root = Path(os.environ.get("SETDIFF_KERNEL_DIR") or Path.home() / ".cache" / "setdiff_mega" / "kernels")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = _loose(os.stat(root), f"the kernel cache directory {root}")
    if problem:
        raise KernelError(f"{problem}: refusing it; chmod 700 it or set SETDIFF_KERNEL_DIR to a private directory")
    return root


def _sha256(path, flags: int = 0) -> str:
    """The file's SHA-256, read through one descriptor (``flags``: e.g. O_NOFOLLOW) that is also checked."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        problem = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else _loose(st, "the library")
        if problem:
            raise KernelError(problem)
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check(lib: Path) -> None:
    """KernelError (one line) unless the library at ``lib`` passes the checks of the module docstring."""
    try:
        _problem(lib)
    except KernelError as e:
        raise KernelError(f"refusing the cached kernels {lib}: {e}") from None


def _problem(lib: Path) -> None:
    entry, record = lib.parent, lib.parent / HASH_NAME
    try:
        est = os.lstat(entry)
        digest = _sha256(lib, getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise KernelError("it is a symbolic link" if e.errno == errno.ELOOP else e.strerror) from None
    problem = f"{entry} is not a directory" if not stat.S_ISDIR(est.st_mode) else _loose(est, f"its directory {entry}")
    if problem:
        raise KernelError(problem)
    try:
        rst = os.lstat(record)
        recorded = record.read_text().split()[:1] if stat.S_ISREG(rst.st_mode) else None
    except OSError:
        raise KernelError(f"no {HASH_NAME} records its SHA-256 (not written by this loader)") from None
    problem = f"{HASH_NAME} is not a regular file" if recorded is None else _loose(rst, HASH_NAME)
    if problem:
        raise KernelError(problem)
    if recorded != [digest]:
        raise KernelError(f"its SHA-256 {digest[:16]}... is not the one recorded in {HASH_NAME} (changed after "
                          f"its build)")


def _discard(entry: Path, why: str) -> None:
    """Remove a refused cache entry (renamed aside first, so no other process sees half of it)."""
    log.warning("%s; rebuilding the CPU decode kernels", why)
    try:
        if stat.S_ISDIR(os.lstat(entry).st_mode):
            aside = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".refused-"))
            os.rename(entry, aside / "entry")
            shutil.rmtree(aside)
        else:
            os.unlink(entry)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise KernelError(f"{why}; cannot remove it ({e.strerror})") from None


def _build() -> Path:
    """The library's path in the cache, compiled now unless an entry of the same key that passes the checks is
    already there (a refused one is removed and rebuilt)."""
    cxx = _compiler()
    if cxx is None:
        raise KernelError(f"no C++ compiler ({'$CXX=' + os.environ['CXX'] if os.environ.get('CXX') else 'g++ or c++'}"
                          f" not found on PATH)")
    source = _source()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([source, " ".join(FLAGS), version, _cpu_flags()]).encode()).hexdigest()[:16]
    root = _root()
    entry = root / f"cpu_kernels-{key}"
    lib = entry / LIBRARY_NAME
    if os.path.lexists(entry):
        try:
            _check(lib)
            return lib
        except KernelError as e:
            _discard(entry, str(e))
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))          # 0700
    try:
        src, out = staging / SOURCE_NAME, staging / LIBRARY_NAME
        src.write_text(source)                                             # exactly the text of the key
        done = subprocess.run([cxx, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise KernelError(f"{cxx} failed to build {source_path()}: {done.stderr.strip()[-2000:]}")
        os.chmod(out, 0o700)
        (staging / HASH_NAME).write_text(f"{_sha256(out)}  {LIBRARY_NAME}\n")
        try:                                           # the whole entry appears at once, and only where none is:
            os.rename(staging, entry)                  # a concurrent build's entry is never replaced
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return lib


class Library:
    """The loaded library: :meth:`attention` (decode attention) and :meth:`pack` / :meth:`linear` (small-M
    products over a weight packed in panels of :data:`PANEL` output columns); see the module docstring."""

    def __init__(self, path: Path):
        self.path = Path(path)
        _check(self.path)                              # before any of its code runs (in a directory only this
        self.lib = ctypes.CDLL(str(self.path))         # user can change: no swap in between)
        want = declared_signature()
        try:
            get = self.lib.sdm_signature
        except AttributeError:
            raise KernelError(f"refusing the kernels {self.path}: no sdm_signature() (built from another source); "
                              f"declared: {want}") from None
        get.argtypes, get.restype = [], ctypes.c_char_p
        got = get().decode()
        if got != want:
            raise KernelError(f"refusing the kernels {self.path}: their signature {got} is not the declared {want} "
                              f"(cpu_kernels.cpp and cpu_kernels.SIGNATURES disagree)")
        for name, declaration in SIGNATURES.items():
            result, types = _parse(declaration)
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = [CTYPES[t] for t in types], CTYPES[result]
        self._attention, self._linear = self.lib.sdm_decode_attention, self.lib.sdm_linear_panels

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


def load() -> Library:
    """The kernels, built (or found in the cache) and loaded now; KernelError (or OSError) with the reason."""
    return Library(_build())


@functools.lru_cache(maxsize=None)
def library() -> Library | None:
    """The kernels, built and loaded once per process (None, after one warning, where they cannot be)."""
    try:
        return load()
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("CPU decode kernels unavailable (%s); fp32-packed uses oneDNN's linear and SDPA", err)
        return None


__all__ = ["ATTENTION_LABEL", "LINEAR_LABEL", "KernelError", "Library", "MAX_QUERIES", "PANEL", "SIGNATURES",
           "declared_signature", "library", "load", "source_path", "use_source"]
