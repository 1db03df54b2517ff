"""Attention as a sum of rectangular key segments merged by log-sum-exp: the set-causal decomposition of
any set of query rows (a context-parallel rank's chunks) without a mask.

A *plan* lists, for query rows of a local sequence q [B, H, T_q, d] and keys k / v [B, H, T_k, d] in
position order, the parts whose union is each row's allowed key set (disjoint within a row):

    ("attn", q0, q1, k0, k1, causal)   rows q0..q1-1 attend keys k0..k1-1; causal = square, row i sees
                                       keys k0..k0+i (the fused kernel's top-left causal)
    ("self", q0, q1, k0, k1)           row q0+i attends key k0+i only (score scale * <q, k>, value v)

Forward: each part's output O_p and log-sum-exp lse_p (fused flash kernel, or the explicit self score)
are merged per row, lse = log(sum_p e^{lse_p}) and O = sum_p e^{lse_p - lse} O_p.
Backward: each "attn" part is the kernel's backward called with the *merged* O and lse (its recomputed
probabilities exp(s - lse) are then the merged softmax's and its rowsum(dO * O) term the merged one, as
in :mod:`setdiff_mega.model.setcausal`); a "self" part adds p = exp(s - lse), dS = p (<dO, v_k> - <dO, O>),
dq += dS scale k, dk = dS scale q, dv = p dO.

:func:`setcausal_plan` is the plan of the static set-causal pattern (rank space, clean stream 0..L-1,
noisy stream L..2L-1) for query rows ``rows`` (full-sequence positions, e.g. the chunks
r and 2c-1-r of both streams a CP rank holds) against every key in position order. For a run of
consecutive rows at stream positions p..p+n-1 (local offset o):

    clean: ("attn", o, o+n, 0, p, False) if p > 0,   ("attn", o, o+n, p, p+n, True)
    noisy: ("attn", o, o+n, 0, p, False) if p > 0,   ("attn", o+1, o+n, p, p+n-1, True) if n > 1,
           ("self", o, o+n, L+p, L+p+n)

With rows = 0..2L-1 this is exactly :class:`~setdiff_mega.model.setcausal.SetCausalAttention`'s two
causal calls and the self term. Accumulation is in fp32 (fp64 for fp64 inputs); the output has q's dtype.
"""
from __future__ import annotations

import torch


def flash_fwd(q, k, v, scale, causal: bool = True):
    """Fused attention -> (out [B, H, Tq, d], lse [B, H, Tq] fp32, what the backward needs besides)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def flash_bwd(dout, q, k, v, out, lse, aux, scale, causal: bool = True):
    """The fused kernel's backward -> (dq, dk, dv)."""
    if aux is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _runs(rows: list[int], L: int):
    """(local offset, stream position, length, noisy) of each run of consecutive rows within one stream."""
    i, n = 0, len(rows)
    while i < n:
        j = i
        while j + 1 < n and rows[j + 1] == rows[j] + 1 and (rows[j + 1] < L) == (rows[i] < L):
            j += 1
        yield i, rows[i] % L, j - i + 1, rows[i] >= L
        i = j + 1


def setcausal_plan(rows: list[int], L: int) -> tuple:
    """The segment plan of the set-causal pattern over 2L positions for query rows ``rows`` (see above)."""
    parts = []
    for o, p, n, noisy in _runs(list(rows), L):
        if p > 0:
            parts.append(("attn", o, o + n, 0, p, False))
        if not noisy:
            parts.append(("attn", o, o + n, p, p + n, True))
            continue
        if n > 1:
            parts.append(("attn", o + 1, o + n, p, p + n - 1, True))
        parts.append(("self", o, o + n, L + p, L + p + n))
    return tuple(parts)


def _merge(out, lse, q0, q1, o, l):
    """Merge one part (o [B, H, n, d], l [B, H, n]) into rows q0..q1-1 of the running (out, lse), in place."""
    old_o, old_l = out[:, :, q0:q1], lse[:, :, q0:q1]
    m = torch.maximum(old_l, l)
    wa, wb = torch.exp(old_l - m), torch.exp(l - m)
    z = wa + wb
    out[:, :, q0:q1] = (wa[..., None] * old_o + wb[..., None] * o.to(out.dtype)) / z[..., None]
    lse[:, :, q0:q1] = m + torch.log(z)


class SegmentAttention(torch.autograd.Function):
    """(q [B, H, T_q, d], k / v [B, H, T_k, d], plan, scale) -> out [B, H, T_q, d] (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        B, H, Tq, d = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(B, H, Tq, d, dtype=acc)
        lse = q.new_full((B, H, Tq), float("-inf"), dtype=acc)
        auxes, lse_dtype = [], torch.float32
        for part in plan:
            q0, q1, k0, k1 = part[1:5]
            if part[0] == "self":
                s = (q[:, :, q0:q1].to(acc) * k[:, :, k0:k1].to(acc)).sum(-1) * scale
                _merge(out, lse, q0, q1, v[:, :, k0:k1], s)
                auxes.append(None)
                continue
            o, lp, aux = flash_fwd(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], scale, part[5])
            lse_dtype = lp.dtype
            _merge(out, lse, q0, q1, o, lp.to(acc))
            auxes.append(aux)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.auxes, ctx.lse_dtype = plan, scale, auxes, lse_dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, acc = ctx.scale, lse.dtype
        dq = torch.zeros_like(q, dtype=acc)
        dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        for part, aux in zip(ctx.plan, ctx.auxes):
            q0, q1, k0, k1 = part[1:5]
            if part[0] == "self":
                qs, ks, vs = q[:, :, q0:q1].to(acc), k[:, :, k0:k1].to(acc), v[:, :, k0:k1].to(acc)
                do, o = dout[:, :, q0:q1].to(acc), out[:, :, q0:q1].to(acc)
                p = torch.exp((qs * ks).sum(-1) * scale - lse[:, :, q0:q1])
                ds = (p * (do * (vs - o)).sum(-1) * scale)[..., None]
                dq[:, :, q0:q1] += ds * ks
                dk[:, :, k0:k1] += ds * qs
                dv[:, :, k0:k1] += p[..., None] * do
                continue
            a, b, c = flash_bwd(dout[:, :, q0:q1], q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                                out[:, :, q0:q1].contiguous(), lse[:, :, q0:q1].to(ctx.lse_dtype).contiguous(),
                                aux, scale, part[5])
            dq[:, :, q0:q1] += a.to(acc)
            dk[:, :, k0:k1] += b.to(acc)
            dv[:, :, k0:k1] += c.to(acc)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def segment_attention(q, k, v, plan, scale: float) -> torch.Tensor:
    """Attention of q [B, H, T_q, d] over k / v [B, H, T_k, d] (same head count) along ``plan``."""
    return SegmentAttention.apply(q, k, v, plan, float(scale))


__all__ = ["setcausal_plan", "segment_attention", "SegmentAttention", "flash_fwd", "flash_bwd"]
