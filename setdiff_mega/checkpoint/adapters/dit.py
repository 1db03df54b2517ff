"""The reference's DiT releases (setdlms / bd3lms / mdlm: ``model_type`` bd3lm or mdlm, weights under
``backbone.``; ``docs/method.md`` 4.2 and ``../shared/docs/interop.md`` 1c).

Layout (``i`` = block; d = hidden, H heads, head size d / H):

    backbone.vocab_embed.embedding           [V, d]        embedding (untied)
    backbone.blocks.i.norm1.weight           [d]           LayerNorm without bias (eps 1e-5)
    backbone.blocks.i.attn_qkv.weight        [3d, d]       rows (three, H, head) -> megatron-core's (H, three, head)
    backbone.blocks.i.attn_out.weight        [d, d]        no bias
    backbone.blocks.i.norm2.weight           [d]
    backbone.blocks.i.mlp.{0,2}.{weight,bias}              GELU-tanh MLP with bias
    backbone.output_layer.norm_final.weight  [d]
    backbone.output_layer.linear.{weight,bias} [V, d], [V] untied head with bias

RoPE base 10000 on the whole head, rotate-half. Ignored: ``rotary_emb.inv_freq``, the ``static_attention_mask``
buffer, ``sampling_eps_*``. The legacy adaLN checkpoints (``adaln`` true, the bd3lms / MDLM releases) also
hold ``sigma_map`` and ``adaLN_modulation``; their conditioning is constant (sigma = 0, no time
conditioning), so the modulation c = silu(sigma_map(0)) is folded in once (:class:`FoldedAdaLN`): each
LayerNorm's weight becomes w (1 + scale) with bias shift, ``attn_out`` rows and the second MLP linear
(weight and bias) are scaled by their gates; the model then has LayerNorms with bias.

The objective comes from the config (:func:`~.base.release_objective`).
"""
from __future__ import annotations

import re

import torch

from setdiff_mega.errors import CheckpointError

from .base import Adapter, release_objective
from .layout import Rule

P = "backbone."
_L = r"decoder\.layers\.(?P<i>\d+)\."
_K = r"\.(?P<kind>weight|bias)"
_B = P + "blocks.{i}."


def qkv_to_mcore(parts: tuple, mc) -> torch.Tensor:
    """(three, H, head) rows -> megatron-core's grouped (H, three, head) rows (no GQA)."""
    w, heads = parts[0], mc.num_attention_heads
    return w.reshape(3, heads, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()


def qkv_from_mcore(t: torch.Tensor, mc) -> tuple:
    heads = mc.num_attention_heads
    return (t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous(),)


RULES = (
    Rule(r"embedding\.word_embeddings\.weight", (P + "vocab_embed.embedding",), vocab=True),
    Rule(r"decoder\.final_layernorm" + _K, (P + "output_layer.norm_final.{kind}",)),
    Rule(r"output_layer" + _K, (P + "output_layer.linear.{kind}",), vocab=True),
    Rule(_L + r"input_layernorm" + _K, (_B + "norm1.{kind}",)),
    Rule(_L + r"pre_mlp_layernorm" + _K, (_B + "norm2.{kind}",)),
    Rule(_L + r"self_attention\.linear_qkv\.weight", (_B + "attn_qkv.weight",), qkv_from_mcore, qkv_to_mcore),
    Rule(_L + r"self_attention\.linear_proj\.weight", (_B + "attn_out.weight",)),
    Rule(_L + r"mlp\.linear_fc1" + _K, (_B + "mlp.0.{kind}",)),
    Rule(_L + r"mlp\.linear_fc2" + _K, (_B + "mlp.2.{kind}",)),
)


def _cfg(raw: dict) -> dict:
    """The backbone's fields: the setdlms config nests them in ``backbone_config``, bd3lms puts them on top."""
    return {**raw, **(raw.get("backbone_config") or {})}


def dit_model(raw: dict, source: str, shapes: dict) -> dict:
    c = _cfg(raw)
    heads = c.get("n_heads", c.get("num_attention_heads"))
    if heads is None:
        raise CheckpointError(f"{source} names no head count (n_heads): the config is not a DiT release's")
    hidden = shapes[P + "vocab_embed.embedding"][1]
    layers = len({n.split(".")[2] for n in shapes if n.startswith(P + "blocks.")})
    adaln = any(".adaLN_modulation." in n for n in shapes)
    return {"family": "dit", "num_layers": layers, "hidden_size": hidden, "num_attention_heads": int(heads),
            "ffn_hidden_size": shapes[P + "blocks.0.mlp.0.weight"][0], "normalization": "LayerNorm",
            "norm_bias": adaln, "norm_eps": 1e-5, "activation": "gelu_tanh", "add_bias_linear": False,
            "mlp_bias": True, "head_bias": True, "tie_embeddings": False, "zero_init_head": True,
            "rotary_base": 10000.0, "hidden_dropout": float(c.get("dropout", 0.1)),
            "max_position_embeddings": int(c.get("length", c.get("model_length", 1024)))}


class FoldedAdaLN:
    """A weights view with the constant adaLN modulation folded in (see the module docstring): ``get`` and
    ``shapes`` like :class:`~.weights.HFWeights`, without the conditioning tensors."""

    def __init__(self, weights):
        self.w, self.shard_rank = weights, weights.shard_rank
        c = self._condition()
        self.mod = {}
        for n in weights.shapes:
            if n.endswith("adaLN_modulation.weight"):
                owner = n[: -len("adaLN_modulation.weight")]
                bias = weights.get(owner + "adaLN_modulation.bias").float()
                m = torch.nn.functional.linear(c, weights.get(n).float(), bias)
                self.mod[owner] = m.chunk(6 if ".blocks." in owner else 2)
        self.shapes = {k: v for k, v in weights.shapes.items() if "adaLN_modulation" not in k and "sigma_map" not in k}
        for owner in self.mod:
            for norm in (("norm1", "norm2") if ".blocks." in owner else ("norm_final",)):
                self.shapes[f"{owner}{norm}.bias"] = self.shapes[f"{owner}{norm}.weight"]

    def _condition(self) -> torch.Tensor:
        """c = silu(sigma_map(0)): the timestep embedding of 0 is [cos 0 ..., sin 0 ...] = [1 ..., 0 ...]."""
        w0, b0 = (self.w.get(P + f"sigma_map.mlp.0.{k}").float() for k in ("weight", "bias"))
        w2, b2 = (self.w.get(P + f"sigma_map.mlp.2.{k}").float() for k in ("weight", "bias"))
        half = w0.shape[1] // 2
        freq = torch.cat([torch.ones(half), torch.zeros(w0.shape[1] - half)])
        return torch.nn.functional.silu(torch.nn.functional.linear(torch.nn.functional.silu(
            torch.nn.functional.linear(freq, w0, b0)), w2, b2))

    def close(self) -> None:
        self.w.close()

    def get(self, name: str) -> torch.Tensor:
        m = re.fullmatch(r"(backbone\.blocks\.\d+\.|backbone\.output_layer\.)(.+)\.(weight|bias)", name)
        mod = self.mod.get(m.group(1)) if m else None
        if mod is None:
            return self.w.get(name)
        owner, part, leaf = m.groups()
        if len(mod) == 2:                       # the final layer: shift, scale
            (shift, scale), gate = mod, None
        else:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
            shift, scale = (shift_msa, scale_msa) if part == "norm1" else (shift_mlp, scale_mlp)
            gate = {"attn_out": gate_msa, "mlp.2": gate_mlp}.get(part)
        if part in ("norm1", "norm2", "norm_final"):
            w = self.w.get(f"{owner}{part}.weight")
            return (w.float() * (1 + scale)).to(w.dtype) if leaf == "weight" else shift.to(w.dtype)
        t = self.w.get(name)
        if gate is None:
            return t
        return (t.float() * (gate[:, None] if t.dim() == 2 else gate)).to(t.dtype)


def dit_hf(cfg) -> dict:
    """A setdlms-style ``config.json`` of an export in the DiT layout (adaLN off) that
    :func:`~.base.release_objective` reads back: SetDLM as model_type bd3lm with its noise config, BD3LM /
    MDLM as their own model_type."""
    mc, oc, L = cfg.model, cfg.objective, cfg.data.seq_length
    if mc.kv_channels not in (None, mc.hidden_size // mc.num_attention_heads) or \
            mc.query_groups != mc.num_attention_heads or mc.rotary_percent != 1.0 or mc.activation != "gelu_tanh":
        raise CheckpointError("the DiT layout has full-width heads without GQA, RoPE on the whole head and a "
                              "GELU-tanh MLP; this model is not a DiT: export it with to-hf (the project's format)")
    if mc.norm_bias:
        raise CheckpointError("this DiT has LayerNorm biases (a legacy adaLN release with its modulation folded "
                              "in), which the release layout cannot hold: export it with to-hf (the project's format)")
    opts = oc.options
    if oc.method.causal:
        raise CheckpointError("the DiT layout holds the diffusion releases (SetDLM, BD3LM, MDLM), not AR models")
    noise = {"desired_block_size": getattr(opts, "D", None), "max_block_size": getattr(opts, "s_max", None),
             "length": L}
    method = {"model_type": "bd3lm", "noise_config": noise} if hasattr(opts, "D") else \
        {"model_type": oc.name, **({"block_size": opts.block_size} if hasattr(opts, "block_size") else {})}
    return {**method, "length": L, "vocab_size": mc.vocab_size,
            "backbone_config": {"hidden_size": mc.hidden_size, "num_layers": mc.num_layers,
                                "n_heads": mc.num_attention_heads, "dropout": mc.hidden_dropout, "adaln": False,
                                "length": mc.max_position_embeddings}}


ADAPTER = Adapter("dit", ("bd3lm", "mdlm"), ("BD3LM", "MDLM", "DIT"), dit_model, dit_hf, rules=RULES,
                  transformers_config=False, mask_tokens=("<|fim_middle|>", "[MASK]"),
                  ignore=(r".*rotary_emb\.inv_freq", r".*static_attention_mask", r".*sampling_eps_m(in|ax)"),
                  claims=lambda raw, names: any(n.startswith(P + "blocks.") for n in names),
                  objective=release_objective, any_objective=True, fold=lambda w: FoldedAdaLN(w) if any(
                      "adaLN_modulation" in n for n in w.shapes) else w)
ADAPTERS = (ADAPTER,)

__all__ = ["ADAPTERS", "ADAPTER", "FoldedAdaLN", "qkv_to_mcore", "qkv_from_mcore"]
