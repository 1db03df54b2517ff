"""One decode forward of an exported model as a flat function over prepared weights (no module calls).

The same function as ``SetDLMForDiffusionLM.forward`` (and the native model), arranged for the small
chunks decoding feeds (a few tokens against a KV cache), where the cost is the number of operations,
not their size:

    weights  per layer: norm 1, W_qkv = [W_q ; W_k ; W_v] (one matmul), W_o, norm 2, W_up (SwiGLU:
             [W_gate ; W_up], one matmul), W_down; the final norm; the head's rows of the real
             vocabulary, each a :class:`~.linears.Product` in the decode-weights format (fp32 by
             default: F.linear, bit-identical to the model; fp32-packed, bf16, int8: :mod:`.linears`).
             Built once by :class:`Prepared` (the fused matrices are copies: one extra copy of the
             attention and up-projection weights while a decoder is alive; other formats hold their own
             copy of every matrix) and rebuilt by :meth:`Prepared.current` when a parameter was replaced
             or changed in place or the format changed.
    forward  tokens / positions [B, T], keep [B, 1|-, T, C + T] bool; q, k, v = split(x W_qkv) as
             [B, heads + 2 groups, T, d]; the per-head q / k norms if the model has them; RoPE
             (rotate-half on the first rot_dim channels) on the q and k heads in one operation;
             attention over [cache ; chunk] through ``cache.attend`` (or plain SDPA over the chunk
             without a cache; in fp32-packed the cache's attention tries :mod:`.cpu_kernels`' attention
             first: chunks of <= 16 queries over a float32 cache), with the boolean mask turned into SDPA's additive
             0 / -inf mask once per forward instead of once per layer; the final norm and the head only
             on rows >= start.

Rows of the chunk never interact except through attention, so computing the norm and head only for the
rows whose logits are asked for changes nothing. For the same reason a cached chunk's padding (``valid`` [B, T]
False: rows with shorter pending runs or windows than the widest, fusion's filler; decoding/calls.py) is left out
of every norm and product: with its N real entries at flat indices p = b * T + t, h is [1, N, H] through the
layers, q / k / v are scattered into the chunk's [B, heads, T, d] layout (zeros at the padding) for attention and
its output gathered back at p; the head runs on the real entries at t >= start and the padding's logits are
zeros (never read). Each real entry's values are those of the padded forward (bit for bit in fp32: tested).
``DecodeModel`` asks for it on CPU only (a GPU decode forward is launch-bound).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .cpu_kernels import library
from .linears import Product, check


def inverse_frequencies(dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE's [dim / 2] inverse frequencies base^(-2i / dim) (float32), rescaled by ``scaling`` (Hugging
    Face's ``rope_scaling`` / ``rope_parameters``; ``rope_type`` llama3 or default)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        return llama3_scaled(inv, scaling)
    if kind != "default":
        raise ValueError(f"RoPE scaling {kind!r} is not supported (llama3 or none)")
    return inv


def llama3_scaled(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's rule: wavelengths above original / low_freq_factor divided by ``factor``, below
    original / high_freq_factor kept, and a smooth blend of the two in between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype) -> tuple:
    """[B, T] positions -> (cos, sin) [B, 1, T, rot_dim] in ``dtype`` (frequencies repeated over the halves)."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def rotate(x, cos, sin):
    """Rotate-half RoPE on the first rot_dim = cos.shape[-1] channels of x [.., T, d]."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _norm_params(norm) -> tuple:
    return norm.weight, getattr(norm, "bias", None), float(norm.eps)


class Prepared:
    """Flat weights of a ``SetDLMForDiffusionLM`` for :func:`forward`."""

    def __init__(self, model, decode_weights: str = "fp32"):
        c = model.config
        self.format = check(decode_weights)
        rows = 2 * int((getattr(c, "method", None) or {}).get("D", 8) or 8)     # oneDNN's rows hint: ~2W
        body = model.model
        self.rms = c.normalization == "RMSNorm"
        self.gated = c.hidden_act == "swiglu"
        self.approximate = "tanh" if c.hidden_act == "gelu_tanh" else "none"
        self.heads, self.groups = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.head_dim
        self.embed = body.embed_tokens.weight
        # on the weights' device: no host-to-device copy inside a forward (a captured step allows none)
        inv_freq = inverse_frequencies(body.rotary.dim, body.rotary.base, body.rotary.scaling)
        self.inv_freq = inv_freq.to(self.embed.device)
        self.layers, self.qk_norms = [], []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            if hasattr(a, "q_norm"):
                self.qk_norms.append((_norm_params(a.q_norm), _norm_params(a.k_norm)))
            qkv_b = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            ups = [m.gate_proj, m.up_proj] if self.gated else [m.up_proj]
            up_b = None if ups[0].bias is None else torch.cat([u.bias for u in ups])
            fmt, qkv_w = self.format, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            self.layers.append((_norm_params(layer.input_layernorm), Product(qkv_w, qkv_b, fmt, rows),
                                Product(a.o_proj.weight, a.o_proj.bias, fmt, rows),
                                _norm_params(layer.post_attention_layernorm),
                                Product(torch.cat([u.weight for u in ups]), up_b, fmt, rows),
                                Product(m.down_proj.weight, m.down_proj.bias, fmt, rows)))
        self.final = _norm_params(body.norm)
        v = c.tokenizer_vocab_size
        if model.lm_head_tied:
            bias = getattr(model, "lm_head_bias", None)
            head = (body.embed_tokens.weight[:v], None if bias is None else bias[:v])
        else:
            head = (model.lm_head.weight[:v], None if model.lm_head.bias is None else model.lm_head.bias[:v])
        self.head = Product(*head, self.format, rows // 2)
        self.params = list(model.parameters())
        self.key = _key(self.params)
        # fp32-packed: the decode chunk's attention over a float32 cache by the small C++ kernel (None: SDPA)
        kernels = library() if self.format == "fp32-packed" and self.embed.device.type == "cpu" else None
        self.attention = None if kernels is None else kernels.attention

    def nbytes(self) -> int:
        """Bytes of weights one forward reads (every layer's products and the head; norms and the few embedding
        rows gathered are left out: they are < 0.1 % at any shape decoding cares about)."""
        return sum(p.nbytes for layer in self.layers for p in layer if isinstance(p, Product)) + self.head.nbytes

    @staticmethod
    def current(model, prepared: "Prepared | None", decode_weights: str = "fp32") -> "Prepared":
        """``prepared`` if it is in ``decode_weights`` and the model's parameters are still the ones it was built
        from (same storage, not modified in place), else a new one."""
        if prepared is not None and prepared.format == decode_weights and prepared.key == _key(prepared.params):
            return prepared
        return Prepared(model, decode_weights)


def _key(params: list) -> list:
    return [(p.data_ptr(), p._version) for p in params]


def _norm(x, p, rms: bool):
    w, b, eps = p
    if rms:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


@torch.no_grad()
def forward(w: Prepared, tokens, position_ids, keep, logits_start: int = 0, cache=None, valid=None):
    """logits [B, T - logits_start, V] of one chunk (see the module docstring). ``valid`` [B, T] bool (with a
    cache): the chunk's real entries; the others are padding, left out of every product and norm (their logits
    are zeros, their K / V zeros). Under torch.profiler each layer and the head are labelled (``decode layer i``,
    ``decode head``); otherwise nothing is recorded."""
    B, T = tokens.shape
    packed = None
    if valid is not None and cache is not None and not bool(valid.all()):
        packed = valid.reshape(-1).nonzero()[:, 0]           # [N] flat indices b * T + t of the real entries
        tokens, position_ids = tokens.reshape(-1)[packed][None], position_ids.reshape(-1)[packed][None]
    h = F.embedding(tokens, w.embed)
    cos, sin = rope_cos_sin(position_ids, w.inv_freq, h.dtype)
    keep = keep[:, None] if keep.dim() == 3 else keep
    if keep.dtype == torch.bool:           # the additive mask SDPA would build in every layer, built once
        keep = torch.zeros(keep.shape, dtype=h.dtype, device=h.device).masked_fill_(~keep, float("-inf"))
    label = torch.profiler.record_function if torch._C._autograd._profiler_enabled() else None
    shape = (B, T, packed)
    for i, layer in enumerate(w.layers):
        if label is None:
            h = _layer(w, i, layer, h, cos, sin, keep, cache, shape)
        else:
            with label(f"decode layer {i}"):
                h = _layer(w, i, layer, h, cos, sin, keep, cache, shape)
    if packed is not None:
        return _packed_head(w, h[0], packed, B, T, logits_start, label)
    return _head(w, _norm(h[:, logits_start:], w.final, w.rms), label)


def _head(w: Prepared, h, label):
    """The head's logits of the final-normed h (labelled ``decode head`` under torch.profiler)."""
    if label is None:
        return w.head(h)
    with label("decode head"):
        return w.head(h)


def _packed_head(w: Prepared, h, packed, B: int, T: int, start: int, label):
    """The logits [B, T - start, V] of the real entries at columns >= start (zeros elsewhere) from their hidden
    states h [N, H] (``packed``: their flat indices)."""
    col = packed % T
    sel = col >= start
    logits = _head(w, _norm(h[sel], w.final, w.rms), label)
    out = logits.new_zeros(B * (T - start), logits.shape[-1])
    out[(packed // T)[sel] * (T - start) + col[sel] - start] = logits
    return out.view(B, T - start, logits.shape[-1])


def _layer(w: Prepared, i: int, layer: tuple, h, cos, sin, keep, cache, shape):
    """Layer ``i``: h + attention(norm1 h), then + MLP(norm2 .) (the module docstring's forward). ``shape`` (B, T,
    packed): with ``packed`` (flat indices of the real entries) h is [1, N, H], the products and norms run over
    the N real entries and attention over the chunk's [B, T] layout (zeros at its padding)."""
    n1, qkv_proj, o_proj, n2, up_proj, down_proj = layer
    b, t = h.shape[:2]
    nh, g, d = w.heads, w.groups, w.head_dim
    gqa = nh != g
    qkv = qkv_proj(_norm(h, n1, w.rms)).view(b, t, nh + 2 * g, d).transpose(1, 2)
    if w.qk_norms:
        qn, kn = w.qk_norms[i]
        normed = (_norm(qkv[:, :nh], qn, w.rms), _norm(qkv[:, nh:nh + g], kn, w.rms))
        qk = rotate(torch.cat(normed, dim=1), cos, sin)
    else:
        qk = rotate(qkv[:, :nh + g], cos, sin)
    B, T, packed = shape
    if packed is not None:                 # back to the chunk's layout for attention
        full = qkv.new_zeros(B * T, nh + 2 * g, d)
        full[packed] = torch.cat([qk, qkv[:, nh + g:]], 1)[0].transpose(0, 1)
        qk = qkv = full.view(B, T, nh + 2 * g, d).transpose(1, 2)
    q, k, v = qk[:, :nh], qk[:, nh:nh + g], qkv[:, nh + g:]
    if cache is not None:
        out = cache.attend(i, q, k, v, keep, enable_gqa=gqa, kernel=w.attention)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(B, T, nh * d)
    if packed is not None:
        out = out.reshape(B * T, nh * d)[packed][None]
    h = h + o_proj(out)
    x = up_proj(_norm(h, n2, w.rms))
    if w.gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    else:
        x = F.gelu(x, approximate=w.approximate)
    return h + down_proj(x)


__all__ = ["Prepared", "forward", "inverse_frequencies", "rope_cos_sin", "rotate"]
