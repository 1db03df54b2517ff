"""Model FLOPs per training sample for each objective, and model FLOPs utilisation (MFU).

Counted for one L-token sample, forward + backward (3x the forward), with T processed positions
(AR: L - 1; MDLM: L; BD3LM and SetDLM: 2L) and N positions that need logits (AR, MDLM: T; BD3LM,
SetDLM: the L noisy positions only, the head is sliced; with ``model.shift_logits``, all 2L):

    linear   = 6 * T * P_body                    P_body: parameters of the transformer layers
    head     = 6 * N * H * V_padded              (the embedding lookup is free)
    attention = 12 * layers * H * T^2            scores and weighted values over all T x T pairs

Attention is counted dense (T^2) for every objective: the set-causal, block and causal masks are run
by dense kernels unless a structured backend skips the masked blocks, so this is the work the
hardware does; it is the convention of Megatron-LM's MFU for causal models as well. MFU divides the
achieved model FLOP/s by the accelerator's dense bf16 peak.
"""
from __future__ import annotations

import torch

from setdiff_mega import methods

# dense bf16 peak TFLOP/s per device (no sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "B200": 2250.0, "GH200": 989.0}


def processed_positions(objective: str, L: int, shift_logits: bool = False) -> tuple[int, int]:
    """(T positions the model processes, N positions that get logits) per L-token sample (the method's
    registry record, :meth:`setdiff_mega.methods.Method.positions`)."""
    return methods.get(objective).positions(L, shift_logits)


def body_parameters(mc) -> int:
    """Parameters of the transformer layers (attention, MLP, norms), from the model config."""
    h, heads, groups, d, ffn = mc.hidden_size, mc.num_attention_heads, mc.query_groups, mc.head_dim, mc.ffn_size
    up = 2 if mc.activation == "swiglu" else 1
    qkv = (h + int(mc.qkv_has_bias)) * (heads + 2 * groups) * d
    proj = heads * d * h + int(mc.add_bias_linear) * h
    mlp = (h + int(mc.mlp_has_bias)) * ffn * up + ffn * h + int(mc.mlp_has_bias) * h
    norms = 2 * norm_parameters(mc, h) + (2 * norm_parameters(mc, d) if mc.qk_layernorm else 0)
    return mc.num_layers * (qkv + proj + mlp + norms)


def norm_parameters(mc, width: int) -> int:
    """Parameters of one norm over ``width`` channels (LayerNorm: weight and bias unless ``norm_bias`` is off)."""
    return width * (2 if mc.normalization == "LayerNorm" and mc.norm_bias else 1)


def flops_terms(mc, padded_vocab: int, objective: str, L: int, every_row: bool = False) -> dict:
    """The linear, head and attention terms of :func:`flops_per_sample` (see the module docstring);
    ``every_row``: the objective's options read logits on every row (``Options.every_row_logits``)."""
    T, N = processed_positions(objective, L, mc.shift_logits or every_row)
    return {"linear": 6.0 * T * body_parameters(mc), "head": 6.0 * N * mc.hidden_size * padded_vocab,
            "attention": 12.0 * mc.num_layers * mc.hidden_size * T * T}


def flops_per_sample(mc, padded_vocab: int, objective: str, L: int, every_row: bool = False) -> float:
    """Model FLOPs (forward + backward) of one L-token training sample."""
    return sum(flops_terms(mc, padded_vocab, objective, L, every_row).values())


def peak_flops(override_tflops: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of this process's device (None on CPU or an unknown GPU)."""
    if override_tflops:
        return override_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key] * 1e12
    return None


__all__ = ["flops_per_sample", "flops_terms", "processed_positions", "body_parameters", "norm_parameters",
           "peak_flops", "PEAK_TFLOPS"]
