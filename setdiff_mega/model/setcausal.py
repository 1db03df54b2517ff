"""Mask-free set-causal attention: two causal kernel calls and a log-sum-exp merge (method.md section 4.4, option 2).

In rank space (tokens sorted by their order sigma) the 2L SetDLM input is [clean_0..clean_{L-1} ;
noisy_0..noisy_{L-1}] and the static set-causal mask allows

    clean query r -> clean keys 0..r                      (plain causal attention)
    noisy query r -> clean keys 0..r-1, and noisy key r   (strictly causal + the self term)

So, with q/k/v split into their clean (c) and noisy (n) halves, each [B, H, L, d]:

    out_c          = causal_attention(q_c, k_c, v_c)
    out_A, lse_A   = causal_attention(q_n[1:], k_c[:-1], v_c[:-1])      rows 1..L-1 (row 0 has no clean key)
    s_r            = scale * <q_n[r], k_n[r]>                            the self score
    out_n[r]       = (e^{lse_A[r]} out_A[r] + e^{s_r} v_n[r]) / (e^{lse_A[r]} + e^{s_r})
    lse_n[r]       = log(e^{lse_A[r]} + e^{s_r})                         (row 0: out_n = v_n[0] exactly)

No 2L x 2L mask is built. The kernels return the log-sum-exp but give no gradient through it, so the
backward is written out (:class:`SetCausalAttention`): the clean half is the kernel's causal backward; the
noisy queries' clean-key part is the same kernel backward called with the *merged* output and
log-sum-exp (its recomputed probabilities exp(s_j - lse_n) are then the merged softmax's, and its
rowsum(dO * O) term is the merged one); the self term is added by hand:
p_r = exp(s_r - lse_n[r]), dS_r = p_r (<dO_r, v_n[r]> - <dO_r, out_n[r]>), dq_n += dS_r * scale * k_n[r],
dk_n[r] = dS_r * scale * q_n[r], dv_n[r] = p_r dO_r.

Pinned context and right padding need no mask here: pinned tokens take the first ranks, padding the last,
so a real token's row never reaches a padding key; padding rows produce finite values nobody reads. Packed rows
(the pattern's ``documents``) run the decomposition once per document, over its own slots of both streams
(:func:`document_setcausal_attention`): an order never leaves its document, so each is a set-causal sequence.
The kernels are PyTorch's fused flash attention: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu``
(any float dtype), on CUDA ``aten._scaled_dot_product_flash_attention`` (bf16 / fp16, head dim <= 256 and a
multiple of 8), each with its backward; the halves are passed as strided views (no copies), and the merge
and the self-term gradients are pointwise helpers that ``torch.compile`` fuses into one kernel each on
CUDA. For other inputs (fp32 on CUDA, other devices) :func:`setcausal_attention` runs
:func:`setcausal_attention_math`, the same decomposition with plain differentiable ops.

:class:`SetCausalCoreAttention` ("setcausal" backend) applies it inside the model when the mask's pattern is
set-causal (two-stream, block size 1) with valid keys first in each stream and a fused kernel takes the
inputs (a context-parallel rank's view of the pattern, :meth:`MaskPattern.view`, runs the same
decomposition over its own query chunks and the gathered keys through
:func:`~setdiff_mega.model.segments.segment_attention`); every other mask (AR, MDLM, BD3LM, KV-cached
decoding), attention dropout and inputs without a
kernel (fp32 on CUDA) take the SDPA path of its base class. Before its first use on a device / dtype / head
dim the fused path checks itself against the plain-ops decomposition (:func:`kernel_verified`).
"""
from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F

from .attention import SDPACoreAttention, expand_groups
from .segments import flash_bwd as _flash_bwd
from .segments import flash_fwd as _flash_fwd
from .segments import segment_attention, setcausal_plan


def kernel_supported(q: torch.Tensor) -> bool:
    """True where a fused causal kernel with a log-sum-exp output and backward exists for ``q``."""
    if q.device.type == "cpu":
        return q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    d = q.shape[-1]
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and d <= 256 and d % 8 == 0


def setcausal_attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The same decomposition with plain differentiable ops (any device, autograd backward): the
    strictly-causal part's log-sum-exp comes from explicit L x L scores. Used where no fused kernel takes
    the inputs (:func:`kernel_supported`), and as a second reference in the tests."""
    L = q.shape[2] // 2
    qc, qn, kc, kn, vc, vn = q[:, :, :L], q[:, :, L:], k[:, :, :L], k[:, :, L:], v[:, :, :L], v[:, :, L:]
    strictly_earlier = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
    oc = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)
    scores = (qn.float() @ kc.float().transpose(-1, -2)) * scale                   # [B, H, L, L]
    scores = scores.masked_fill(~strictly_earlier, float("-inf"))
    s_self = (qn.float() * kn.float()).sum(-1, keepdim=True) * scale
    lse = torch.logsumexp(torch.cat([scores, s_self], -1), -1, keepdim=True)
    on = torch.exp(scores - lse) @ vc.float() + torch.exp(s_self - lse) * vn.float()
    return torch.cat([oc, on.to(q.dtype)], dim=2)


def _merge_self(o_a, lse_a, qn, kn, vn, scale: float):
    """Merge the strictly-causal part (rows 1..L-1: o_a [B, H, L-1, d], lse_a [B, H, L-1]) with the self term.
    Returns (out_n [B, H, L, d] in q's dtype, lse_n [B, H, L] fp32, s_self [B, H, L] fp32). Row 0 has
    lse_a = -inf, so its output is v_n[0] exactly."""
    s_self = (qn.float() * kn.float()).sum(-1) * scale
    lse_a = F.pad(lse_a.float(), (1, 0), value=float("-inf"))
    o_a = F.pad(o_a.float(), (0, 0, 1, 0))
    m = torch.maximum(lse_a, s_self)
    wa, ws = torch.exp(lse_a - m), torch.exp(s_self - m)
    z = wa + ws
    out = (wa[..., None] * o_a + ws[..., None] * vn.float()) / z[..., None]
    return out.to(qn.dtype), m + torch.log(z), s_self


def _self_grads(don, on, qn, kn, vn, s_self, lse_n, scale: float):
    """Gradients of the self term: p = exp(s_self - lse_n), dS = p <dO, v_n - out_n>;
    returns (dq_n part [fp32], dk_n, dv_n)."""
    p = torch.exp(s_self - lse_n.float())
    dfl = don.float()
    ds = (p * (dfl * (vn.float() - on.float())).sum(-1) * scale)[..., None]
    return ds * kn.float(), (ds * qn.float()).to(kn.dtype), (p[..., None] * dfl).to(vn.dtype)


class _Fused:
    """A pointwise helper, compiled into one kernel on CUDA (eager elsewhere, or if compiling fails)."""

    def __init__(self, fn):
        self.fn, self.compiled, self.failed = fn, None, False

    def __call__(self, *args):
        if not args[0].is_cuda or self.failed:
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn)
        try:
            return self.compiled(*args)
        except Exception as e:        # noqa: BLE001 - a compiler problem must not stop training
            warnings.warn(f"torch.compile of {self.fn.__name__} failed ({type(e).__name__}: {e}); running eagerly")
            self.failed = True
            return self.fn(*args)


_merge_self_fused, _self_grads_fused = _Fused(_merge_self), _Fused(_self_grads)


class SetCausalAttention(torch.autograd.Function):
    """(q, k, v) [B, H, 2L, d] in rank space -> out [B, H, 2L, d] under the static set-causal pattern.
    The halves are strided views (the kernels take any layout with a unit last stride): no copies."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        L = q.shape[2] // 2
        qc, qn, kc, kn, vc, vn = q[:, :, :L], q[:, :, L:], k[:, :, :L], k[:, :, L:], v[:, :, :L], v[:, :, L:]
        oc, lse_c, aux_c = _flash_fwd(qc, kc, vc, scale)
        if L > 1:
            o_a, lse_a, aux_a = _flash_fwd(qn[:, :, 1:], kc[:, :, :-1], vc[:, :, :-1], scale)
        else:
            o_a, lse_a, aux_a = qn[:, :, :0], qn.new_empty(qn.shape[:2] + (0,), dtype=torch.float32), None
        on, lse_n, s_self = _merge_self_fused(o_a, lse_a, qn, kn, vn, scale)
        ctx.save_for_backward(q, k, v, oc, lse_c, on, lse_n, s_self)
        ctx.scale, ctx.aux_c, ctx.aux_a = scale, aux_c, aux_a
        return torch.cat([oc, on], dim=2)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, oc, lse_c, on, lse_n, s_self = ctx.saved_tensors
        scale, L = ctx.scale, q.shape[2] // 2
        qc, qn, kc, kn, vc, vn = q[:, :, :L], q[:, :, L:], k[:, :, :L], k[:, :, L:], v[:, :, :L], v[:, :, L:]
        doc, don = dout[:, :, :L], dout[:, :, L:]
        dqc, dkc, dvc = _flash_bwd(doc, qc, kc, vc, oc, lse_c, ctx.aux_c, scale)
        dqn, dkn, dvn = _self_grads_fused(don, on, qn, kn, vn, s_self, lse_n, scale)
        if L > 1:   # the clean-key part, with the merged output and log-sum-exp (see the module docstring)
            dq1, dk1, dv1 = _flash_bwd(don[:, :, 1:], qn[:, :, 1:], kc[:, :, :-1], vc[:, :, :-1],
                                       on[:, :, 1:].contiguous(), lse_n[:, :, 1:].to(lse_c.dtype).contiguous(),
                                       ctx.aux_a, scale)
            dqn[:, :, 1:] += dq1
            dkc[:, :, :-1] += dk1
            dvc[:, :, :-1] += dv1
        return (torch.cat([dqc, dqn.to(q.dtype)], 2), torch.cat([dkc, dkn], 2), torch.cat([dvc, dvn], 2), None)


def setcausal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    """Set-causal attention of a rank-space 2L sequence without a mask; q, k, v [B, H, 2L, d] (same head
    count: expand grouped KV heads first). ``scale`` defaults to 1/sqrt(d)."""
    if q.shape[2] % 2:
        raise ValueError(f"set-causal attention needs the 2L layout (an even length), got {q.shape[2]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not kernel_supported(q):
        return setcausal_attention_math(q, k, v, scale)
    return SetCausalAttention.apply(q, k, v, scale)


def document_setcausal_attention(q, k, v, pattern, scale: float | None = None) -> torch.Tensor:
    """Set-causal attention of packed rows (``pattern.documents``): each document's slots [s, e) of both streams
    are a set-causal 2n sequence of their own (an order never leaves its document), run through
    :func:`setcausal_attention`; the padding tail's rows keep themselves (out = v, as under the dense mask)."""
    L = q.shape[2] // 2
    out = []
    for b, runs in enumerate(pattern.document_slots()):
        clean, noisy = [], []
        for s, e in runs:
            two = [torch.cat([t[b:b + 1, :, s:e], t[b:b + 1, :, L + s:L + e]], 2) for t in (q, k, v)]
            o = setcausal_attention(*two, scale)
            clean.append(o[:, :, :e - s])
            noisy.append(o[:, :, e - s:])
        end = runs[-1][1]
        out.append(torch.cat(clean + [v[b:b + 1, :, end:L]] + noisy + [v[b:b + 1, :, L + end:]], 2))
    return torch.cat(out, 0)


def _setcausal_rows(rows: torch.Tensor, L: int) -> torch.Tensor:
    """The set-causal mask (True = allowed) of query positions ``rows`` against all 2L keys [len(rows), 2L]."""
    q, k = rows[:, None], torch.arange(2 * L, device=rows.device)[None, :]
    qc, kc, i, j = q < L, k < L, q % L, k % L
    return (qc & kc & (j <= i)) | (~qc & kc & (j < i)) | (~qc & ~kc & (j == i))


@functools.lru_cache(maxsize=None)
def kernel_verified(device: str, dtype: torch.dtype, head_dim: int) -> bool:
    """One-time self-check of the fused path on this device / dtype / head dim: outputs and gradients of
    :class:`SetCausalAttention` on a small random input against :func:`setcausal_attention_math` in fp32,
    and of :func:`~setdiff_mega.model.segments.segment_attention` on a CP rank's rows against masked SDPA
    (relative error < 1e-4 in fp32/fp64, < 3e-2 in bf16/fp16). A kernel that behaves differently on some
    platform or PyTorch version then costs speed (the core attention falls back to the dense mask, with a
    warning), never correctness."""
    dev, scale = torch.device(device), 1.0 / math.sqrt(head_dim)
    g = torch.Generator(device=dev).manual_seed(0)
    base = [torch.randn(1, 2, 2 * 37, head_dim, device=dev, generator=g).to(dtype) for _ in range(4)]
    with torch.enable_grad(), torch.autocast(dev.type, enabled=False):
        x = [t.clone().requires_grad_() for t in base[:3]]
        out = SetCausalAttention.apply(*x, scale)
        got = [out, *torch.autograd.grad(out, x, base[3])]
        r = [t.float().requires_grad_() for t in base[:3]]
        ref = setcausal_attention_math(*r, scale)
        want = [ref, *torch.autograd.grad(ref, r, base[3].float())]
        # the segment path of a CP rank's view: chunks 0 and 3 of 4 of both streams, against the masked rows
        L = 36
        rows = torch.tensor([p for s in (0, L) for p in list(range(s, s + 9)) + list(range(s + 27, s + 36))],
                            device=dev)
        x = [t[:, :, :2 * L].clone().requires_grad_() for t in base[:3]]
        out = segment_attention(x[0][:, :, rows], x[1], x[2], setcausal_plan(rows.tolist(), L), scale)
        got += [out, *torch.autograd.grad(out, x, base[3][:, :, :rows.numel()])]
        r = [t[:, :, :2 * L].float().requires_grad_() for t in base[:3]]
        ref = F.scaled_dot_product_attention(r[0][:, :, rows], r[1], r[2], attn_mask=_setcausal_rows(rows, L),
                                             scale=scale)
        want += [ref, *torch.autograd.grad(ref, r, base[3][:, :, :rows.numel()].float())]
    errs = [((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, want)]
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    if not all(e < tol for e in errs):       # NaN compares False: also a failure
        warnings.warn(f"set-causal fused-kernel self-check failed on {device} / {dtype} / head dim {head_dim} "
                      f"(relative errors out, dq, dk, dv, then of the CP view: "
                      f"{', '.join(f'{e:.2e}' for e in errs)}); "
                      f"attention_backend=setcausal uses the dense-mask path here")
        return False
    return True


def pattern_attention(q, k, v, pattern=None, scale=None):
    """The "setcausal" backend's bare kernel (its registry record's ``kernel``): the decomposition over a
    set-causal ``pattern`` of 2L positions (q / k / v [b, h, 2L, d])."""
    return setcausal_attention(q, k, v, scale)


class SetCausalCoreAttention(SDPACoreAttention):
    """Core attention ("setcausal" backend): the decomposition for set-causal patterns, SDPA otherwise."""

    def attend(self, q, k, v, attention_mask, pattern):
        if not self.decomposable(pattern, q):
            return super().attend(q, k, v, attention_mask, pattern)
        if self.active_dropout > 0 or not kernel_supported(q):
            warnings.warn("attention_backend=setcausal falls back to the dense-mask SDPA path: attention dropout "
                          "> 0 or no fused kernel for these inputs (CUDA needs bf16/fp16, head dim <= 256, a "
                          "multiple of 8)")
            return super().attend(q, k, v, attention_mask, pattern)
        if not kernel_verified(str(q.device), q.dtype, q.shape[-1]):
            return super().attend(q, k, v, attention_mask, pattern)
        k, v = expand_groups(k, q.shape[1]), expand_groups(v, q.shape[1])
        if pattern.documents is not None:   # packed rows: one decomposition per document
            return document_setcausal_attention(q, k, v, pattern, self.softmax_scale)
        if pattern.is_view:          # a CP rank's chunks: keys back in position order, then the segment plan
            order, plan = self.view_plan(pattern, q.device)
            scale = 1.0 / math.sqrt(q.shape[-1]) if self.softmax_scale is None else float(self.softmax_scale)
            return segment_attention(q, k.index_select(2, order), v.index_select(2, order), plan, scale)
        return setcausal_attention(q, k, v, self.softmax_scale)

    @staticmethod
    def view_plan(pattern, device):
        """(key order back to positions [T] long, :func:`~setdiff_mega.model.segments.setcausal_plan`)."""
        key = ("setcausal_view_plan", str(device))
        if key not in pattern.cache:
            rows = pattern.rows.tolist() if pattern.rows is not None else list(range(pattern.length))
            order = torch.argsort(pattern.cols) if pattern.cols is not None else torch.arange(pattern.length)
            pattern.cache[key] = order.to(device), setcausal_plan(rows, pattern.length // 2)
        return pattern.cache[key]

    @staticmethod
    def decomposable(pattern, q) -> bool:
        """Set-causal over this input, with every stream's padding (if any) after its valid keys; a view
        must have sorted runs of rows and every position as a key (what a CP rank gathers)."""
        if pattern is None or not pattern.is_setcausal or pattern.num_queries != q.shape[2]:
            return False
        if "decomposable" not in pattern.cache:
            ok = pattern.valid_keys_first()
            if pattern.cols is not None:
                ok = ok and torch.equal(torch.sort(pattern.cols).values,
                                       torch.arange(pattern.length, device=pattern.cols.device))
            pattern.cache["decomposable"] = ok
        return pattern.cache["decomposable"]


__all__ = ["setcausal_attention", "document_setcausal_attention", "pattern_attention", "setcausal_attention_math",
           "SetCausalAttention", "SetCausalCoreAttention", "kernel_supported", "kernel_verified"]
