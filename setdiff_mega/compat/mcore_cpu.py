"""CPU compatibility shim for megatron-core 0.16.1 (applied once, only when CUDA is unavailable).

megatron-core assumes CUDA in a handful of places. On a CPU-only torch build it fails with
"Torch not compiled with CUDA enabled". This module patches exactly those places:

1. ``torch.cuda.current_device()`` returns ``"cpu"`` (used as ``device=`` by buffers, TP mappings, p2p).
2. The CUDA RNG states tracker is replaced by one over the CPU generator, so
   ``model_parallel_cuda_manual_seed`` and dropout under ``get_cuda_rng_tracker().fork()`` work.
3. ``torch.cuda.manual_seed`` and ``torch.cuda.synchronize`` become no-ops.
4. :func:`cuda_redirect`, a scoped torch-function mode, rewrites ``device="cuda"`` factory arguments
   to CPU, makes ``Tensor.cuda()`` the identity and lets ``Tensor.type()`` report ``torch.cuda.*`` names
   (mcore optimizers assert it). Callers enter it around mcore's optimizer / pipeline schedules only.
5. mcore's linear autograd functions restore *CUDA* autocast in their backward (``custom_bwd`` with
   ``device_type="cuda"``); on CPU the backward of a bf16-autocast forward then multiplies a bf16 gradient by
   an fp32 input and fails. Their forward now records the CPU autocast state and their backward runs under
   it, which is what ``custom_bwd`` does on GPUs (``train.precision=bf16`` on CPU).

6. Activation recomputation (``tensor_parallel.checkpoint``) saves and restores the "CUDA" RNG state next
   to the CPU one: on CPU that state is the CPU generator's (restored with it), so recomputed dropout
   draws the same numbers.

Never applied on a GPU machine. :func:`check_targets` fails loudly if an mcore upgrade moves the
patched symbols, so the shim cannot silently stop working.
"""
from __future__ import annotations

import contextlib
import threading

import megatron.core
import torch
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel import random as mrandom
from torch.overrides import TorchFunctionMode

SUPPORTED_MCORE = "0.16.1"
_LOCK = threading.Lock()
_STATE = {"applied": False}


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device requests to the CPU inside megatron-core code paths."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and "cuda" in str(dev):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return func(*args, **kwargs)


def check_targets() -> None:
    """Raise if the megatron-core symbols this shim patches are missing (e.g. after an upgrade)."""
    missing = [n for n in ("CudaRNGStatesTracker", "_MODEL_PARALLEL_RNG_TRACKER_NAME", "get_cuda_rng_tracker",
                           "_get_cuda_rng_state", "_set_cuda_rng_state") if not hasattr(mrandom, n)]
    if missing:
        raise RuntimeError(
            f"setdiff_mega's CPU shim targets megatron-core {SUPPORTED_MCORE}, but "
            f"megatron.core.tensor_parallel.random lacks {missing} (installed: {megatron.core.__version__}). "
            f"Install megatron-core=={SUPPORTED_MCORE} or update setdiff_mega/compat/mcore_cpu.py.")


def is_applied() -> bool:
    return bool(_STATE["applied"])


def apply() -> bool:
    """Apply the shim if CUDA is absent; idempotent. Returns True if the shim is active."""
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _STATE["applied"]:
            return True
        check_targets()
        base = mrandom.CudaRNGStatesTracker

        class CpuRNGStatesTracker(base):
            """RNG tracker over the CPU default generator (same API as the CUDA one)."""

            def add(self, name, seed):
                self._is_initialized = True
                if seed in self.seeds_:
                    raise Exception(f"seed {seed} already exists")
                self.seeds_.add(seed)
                if name in self.states_:
                    raise Exception(f"cuda rng state {name} already exists")
                orig = torch.get_rng_state()
                torch.manual_seed(seed)
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

            @contextlib.contextmanager
            def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
                if name not in self.states_:
                    raise Exception(f"cuda rng state {name} is not added")
                orig = torch.get_rng_state()
                torch.set_rng_state(self.states_[name])
                try:
                    yield
                finally:
                    self.states_[name] = torch.get_rng_state()
                    torch.set_rng_state(orig)

        mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
        # Reset any tracker instance that was created before the patch.
        if hasattr(mrandom, "_CUDA_RNG_STATE_TRACKER"):
            mrandom._CUDA_RNG_STATE_TRACKER = None
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        mrandom._set_cuda_rng_state = lambda *a, **k: None      # the CPU state is set next to it
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.manual_seed = lambda seed: None
        torch.cuda.manual_seed_all = lambda seed: None
        torch.cuda.synchronize = lambda *a, **k: None
        for cls in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
            _cpu_autocast_backward(cls)
        _STATE.update(applied=True)
        return True


def _cpu_autocast_backward(cls) -> None:
    """Run ``cls.backward`` under the CPU autocast state of its forward (custom_bwd, for the CPU)."""
    fwd, bwd = cls.forward, cls.backward

    def forward(ctx, *args, **kwargs):
        ctx.cpu_autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        return fwd(ctx, *args, **kwargs)

    def backward(ctx, *grads):
        enabled, dtype = getattr(ctx, "cpu_autocast", (False, torch.bfloat16))
        with torch.autocast("cpu", dtype=dtype, enabled=enabled):
            return bwd(ctx, *grads)

    cls.forward, cls.backward = staticmethod(forward), staticmethod(backward)


@contextlib.contextmanager
def cuda_redirect():
    """Scope in which ``device="cuda"`` literals, ``Tensor.cuda()`` and ``Tensor.type()`` checks inside
    megatron-core (pipeline schedules, mcore optimizers, grad clipping) work on CPU. A no-op on GPU.

    It is deliberately not global: a torch-function mode intercepts every torch call in Python
    (measured: half the wall time of KV-cached decoding of a small model), and megatron's model
    forward / backward does not need it.
    """
    if torch.cuda.is_available():
        yield
        return
    apply()
    with _CudaToCpuMode():
        yield


__all__ = ["apply", "cuda_redirect", "is_applied", "check_targets", "SUPPORTED_MCORE"]
