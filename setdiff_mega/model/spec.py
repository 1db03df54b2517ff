"""megatron-core layer specs for the set-diffusion transformer.

The layer is mcore's ``TransformerLayer``; only submodules are swapped through the spec:

* ``local`` (CPU, and GPU without Transformer Engine): ``get_gpt_layer_local_spec`` with
  ``attn_mask_type = arbitrary``.
* ``transformer_engine`` (GPU with TE installed): ``get_gpt_layer_with_transformer_engine_spec`` (TE's
  fused norm + linear layers; FP8 through megatron-core's ``fp8`` / ``fp8_recipe`` config). TE is imported
  only here, lazily, and only when requested or auto-detected.

With either, ``attention_backend`` picks the core attention through its record in the backend registry
(:mod:`setdiff_mega.backends`): ``sdpa`` (dense-mask reference,
:class:`~setdiff_mega.model.attention.SDPACoreAttention`), ``flex`` (FlexAttention block mask,
:class:`~setdiff_mega.model.flex.FlexCoreAttention`), ``setcausal`` (mask-free decomposition,
:class:`~setdiff_mega.model.setcausal.SetCausalCoreAttention`), ``local`` (the implementation's own:
mcore ``DotProductAttention``, or TE's ``TEDotProductAttention``, which runs arbitrary masks unfused), or
any backend registered later.
``fp8="torchao"`` swaps the four linear layers of the local spec for
:mod:`~setdiff_mega.model.fp8`'s float8 ones (torchao, TP = 1).

Architecture variants, also by spec: the local spec's norms are :class:`Norm` (LayerNorm with or without
bias, RMSNorm; sequence-parallel capable), per-head q / k norms (``qk_layernorm``, Qwen3) are
:class:`Norm` over the head size, marked ``tp_shared`` (every TP rank holds different heads, so their
gradients are summed over the TP group), and an MLP whose bias differs from the attention's
(``mlp_bias``, the DiT) is :class:`BiasedMLP`.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from setdiff_mega import backends

from .fp8 import float8_linear_specs


class Norm:
    """Torch LayerNorm (``bias`` or not) / RMSNorm for the local spec whose parameters carry megatron-core's
    ``sequence_parallel`` flag, so their gradients (computed on a sequence shard) are summed over the TP
    group; ``tp_shared`` marks a norm applied to this rank's heads only (q / k norms), whose gradients are
    summed over the TP group with or without sequence parallelism. megatron-core's own torch wrapper
    refuses sequence parallelism and a bias-free LayerNorm. Same constructor as megatron-core's norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm", bias: bool = True,
                tp_shared: bool = False):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        else:
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps, bias=bias)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel) and not tp_shared)
            if tp_shared:
                setattr(p, "tp_shared", True)
        return norm


class BiasedMLP(MLP):
    """megatron-core's MLP with its own bias setting (``bias``), whatever ``add_bias_linear`` says for the
    attention's linear layers (the reference's DiT: biased MLP, bias-free attention)."""

    def __init__(self, config, submodules, *args, bias: bool, **kwargs):
        super().__init__(dataclasses.replace(config, add_bias_linear=bias), submodules, *args, **kwargs)


def block_spec(layer, num_layers: int, norm=Norm):
    """The TransformerBlock spec: the layer spec and the final norm (the local spec's :class:`Norm`)."""
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm)


def transformer_engine_available() -> bool:
    """True only on a CUDA machine with an importable Transformer Engine."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def resolve_impl(transformer_impl: str) -> str:
    """'auto' -> 'transformer_engine' when usable, else 'local'; explicit TE without TE is an error."""
    if transformer_impl == "auto":
        return "transformer_engine" if transformer_engine_available() else "local"
    if transformer_impl == "transformer_engine" and not transformer_engine_available():
        raise RuntimeError("model.transformer_impl=transformer_engine needs a CUDA GPU and the [gpu] extra "
                           "(pip install -e '.[gpu]'); use model.transformer_impl=local or auto")
    return transformer_impl


def core_attention_class(attention_backend: str):
    """The core attention module of a backend name (its registry record, :mod:`setdiff_mega.backends`;
    None: keep the implementation's own)."""
    try:
        return backends.get(attention_backend).core_class()
    except backends.BackendError as e:
        raise ValueError(str(e)) from None


def layer_spec(transformer_impl: str = "auto", attention_backend: str = "sdpa",
               normalization: str = "LayerNorm", sequence_parallel: bool = False, fp8: str = "none",
               fp8_recipe: str = "tensorwise", *, qk_layernorm: bool = False, norm_bias: bool = True,
               mlp_bias: bool | None = None):
    """Return (ModuleSpec, resolved_impl) for one transformer layer; ``mlp_bias`` None: the MLP follows
    ``add_bias_linear``."""
    impl = resolve_impl(transformer_impl)
    if impl == "transformer_engine":
        if not norm_bias and normalization == "LayerNorm":
            raise ValueError("model.norm_bias=false (LayerNorm without bias) runs on the local spec: set "
                             "model.transformer_impl=local")
        spec = get_gpt_layer_with_transformer_engine_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization=normalization)
        norm = ModuleSpec(module=Norm, params={"bias": norm_bias})
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        if qk_layernorm:
            qk = ModuleSpec(module=Norm, params={"bias": norm_bias, "tp_shared": True})
            spec.submodules.self_attention.submodules.q_layernorm = qk
            spec.submodules.self_attention.submodules.k_layernorm = qk
    if mlp_bias is not None:
        spec.submodules.mlp = ModuleSpec(module=BiasedMLP, params={"bias": mlp_bias},
                                         submodules=spec.submodules.mlp.submodules)
    if fp8 == "torchao":
        if impl == "transformer_engine":
            raise ValueError("model.fp8=torchao swaps the local spec's linear layers; with Transformer Engine use "
                             "model.fp8=te (or model.transformer_impl=local)")
        float8_linear_specs(spec, fp8_recipe)
    core = core_attention_class(attention_backend)
    if core is not None:
        spec.submodules.self_attention.submodules.core_attention = core
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
    return spec, impl


__all__ = ["Norm", "BiasedMLP", "block_spec", "layer_spec", "core_attention_class", "resolve_impl",
           "transformer_engine_available"]
