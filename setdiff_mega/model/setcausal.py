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
so a real token's row never reaches a padding key; padding rows produce finite values nobody reads.
The kernels are PyTorch's fused flash attention: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu``
(any float dtype), on CUDA ``aten._scaled_dot_product_flash_attention`` (bf16 / fp16, head dim <= 256 and a
multiple of 8), each with its backward. Other inputs (fp32 on CUDA, other devices) run
:func:`setcausal_attention_math`, the same decomposition with plain differentiable ops.

:class:`SetCausalCoreAttention` ("setcausal" backend) applies it inside the model when the mask's pattern is
set-causal (two-stream, block size 1) with valid keys first in each stream; every other mask (AR, MDLM,
BD3LM, KV-cached decoding) and attention dropout take the SDPA path of its base class.
"""
from __future__ import annotations

import math

import torch

from .attention import SDPACoreAttention, expand_groups


def kernel_supported(q: torch.Tensor) -> bool:
    """True where a fused causal kernel with a log-sum-exp output and backward exists for ``q``."""
    if q.device.type == "cpu":
        return q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    d = q.shape[-1]
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and d <= 256 and d % 8 == 0


def _flash_fwd(q, k, v, scale):
    """Causal attention -> (out [B, H, L, d], lse [B, H, L] fp32, what the backward needs besides)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, None
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_bwd(dout, q, k, v, out, lse, aux, scale):
    if aux is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, True, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)


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


class SetCausalAttention(torch.autograd.Function):
    """(q, k, v) [B, H, 2L, d] in rank space -> out [B, H, 2L, d] under the static set-causal pattern."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        L = q.shape[2] // 2
        qc, qn = q[:, :, :L].contiguous(), q[:, :, L:].contiguous()
        kc, kn = k[:, :, :L].contiguous(), k[:, :, L:].contiguous()
        vc, vn = v[:, :, :L].contiguous(), v[:, :, L:].contiguous()
        oc, lse_c, aux_c = _flash_fwd(qc, kc, vc, scale)
        s_self = (qn.float() * kn.float()).sum(-1) * scale                       # [B, H, L]
        lse_a = torch.full_like(s_self, float("-inf"))
        oa = torch.zeros_like(qn, dtype=torch.float32)
        aux_a = None
        if L > 1:
            o1, l1, aux_a = _flash_fwd(qn[:, :, 1:].contiguous(), kc[:, :, :-1].contiguous(),
                                       vc[:, :, :-1].contiguous(), scale)
            oa[:, :, 1:], lse_a[:, :, 1:] = o1.float(), l1.float()
        m = torch.maximum(lse_a, s_self)
        wa, ws = torch.exp(lse_a - m), torch.exp(s_self - m)
        z = wa + ws
        on = ((wa[..., None] * oa + ws[..., None] * vn.float()) / z[..., None]).to(q.dtype)
        lse_n = m + torch.log(z)
        ctx.save_for_backward(qc, kc, vc, qn, kn, vn, oc, lse_c, on, lse_n.to(lse_c.dtype), s_self)
        ctx.scale, ctx.aux_c, ctx.aux_a = scale, aux_c, aux_a
        return torch.cat([oc, on], dim=2)

    @staticmethod
    def backward(ctx, dout):
        qc, kc, vc, qn, kn, vn, oc, lse_c, on, lse_n, s_self = ctx.saved_tensors
        scale = ctx.scale
        L = qc.shape[2]
        doc, don = dout[:, :, :L].contiguous(), dout[:, :, L:].contiguous()
        dqc, dkc, dvc = _flash_bwd(doc, qc, kc, vc, oc, lse_c, ctx.aux_c, scale)
        dqn = torch.zeros_like(qn)
        dkc, dvc = dkc.clone(), dvc.clone()
        if L > 1:
            dq1, dk1, dv1 = _flash_bwd(don[:, :, 1:], qn[:, :, 1:].contiguous(), kc[:, :, :-1].contiguous(),
                                       vc[:, :, :-1].contiguous(), on[:, :, 1:].contiguous(),
                                       lse_n[:, :, 1:].contiguous(), ctx.aux_a, scale)
            dqn[:, :, 1:] += dq1
            dkc[:, :, :-1] += dk1
            dvc[:, :, :-1] += dv1
        p_self = torch.exp(s_self - lse_n.float())                                       # [B, H, L]
        dfl, onf = don.float(), on.float()
        ds = p_self * ((dfl * vn.float()).sum(-1) - (dfl * onf).sum(-1))
        dqn = dqn + (ds[..., None] * scale * kn.float()).to(dqn.dtype)
        dkn = (ds[..., None] * scale * qn.float()).to(kn.dtype)
        dvn = (p_self[..., None] * dfl).to(vn.dtype)
        return (torch.cat([dqc, dqn], 2), torch.cat([dkc, dkn], 2), torch.cat([dvc, dvn], 2), None)


def setcausal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    """Set-causal attention of a rank-space 2L sequence without a mask; q, k, v [B, H, 2L, d] (same head
    count: expand grouped KV heads first). ``scale`` defaults to 1/sqrt(d)."""
    if q.shape[2] % 2:
        raise ValueError(f"set-causal attention needs the 2L layout (an even length), got {q.shape[2]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not kernel_supported(q):
        return setcausal_attention_math(q, k, v, scale)
    return SetCausalAttention.apply(q, k, v, scale)


class SetCausalCoreAttention(SDPACoreAttention):
    """Core attention ("setcausal" backend): the decomposition for set-causal patterns, SDPA otherwise."""

    def attend(self, q, k, v, attention_mask, pattern):
        if not self.decomposable(pattern, q) or self.active_dropout > 0:
            return super().attend(q, k, v, attention_mask, pattern)
        return setcausal_attention(q, expand_groups(k, q.shape[1]), expand_groups(v, q.shape[1]),
                                   self.softmax_scale)

    @staticmethod
    def decomposable(pattern, q) -> bool:
        """Set-causal over this input, with every stream's padding (if any) after its valid keys."""
        if pattern is None or not pattern.is_setcausal or pattern.length != q.shape[2]:
            return False
        if "valid_keys_first" not in pattern.cache:
            pattern.cache["valid_keys_first"] = pattern.valid_keys_first()
        return pattern.cache["valid_keys_first"]


__all__ = ["setcausal_attention", "setcausal_attention_math", "SetCausalAttention", "SetCausalCoreAttention",
           "kernel_supported"]
