"""FP8 linear layers without Transformer Engine: torchao float8 training inside megatron-core's linears.

Two routes to FP8 (``model.fp8``):

* ``te``: the Transformer Engine spec with megatron-core's own FP8 (``TransformerConfig.fp8 = "hybrid"``:
  E4M3 forward, E5M2 gradients; ``fp8_recipe`` ``delayed`` (amax history) or ``tensorwise`` (current
  scaling)). Needs TE, i.e. the ``[gpu]`` extra on a CUDA machine.
* ``torchao`` (this module): the local spec's four linear layers (``linear_qkv``, ``linear_proj``,
  ``linear_fc1``, ``linear_fc2``) become :class:`Float8ColumnParallelLinear` /
  :class:`Float8RowParallelLinear`: megatron-core's layers with the same parameters, initialisation and
  sharded state dict (checkpoints are interchangeable with bf16 runs), whose matmul is torchao's
  ``matmul_with_hp_or_float8_args``: y = x W^T with x and W cast to float8 e4m3 with dynamic scales
  (``tensorwise``: one scale per tensor; ``rowwise``: one per row / column), the same for the backward's
  two matmuls (grad_output in e4m3 / e5m2 as the recipe says), fp32 accumulation, output in x's dtype.
  Hopper (sm_89+) runs ``torch._scaled_mm``; elsewhere torchao *emulates* the casts with high-precision
  matmuls (same rounding, no speed-up), which is what the CPU tests exercise. Tensor parallelism is not
  supported on this route (megatron-core's TP communication lives in the matmul it replaces): TP > 1 is
  refused with a pointer to ``model.fp8=te``. The embedding, the LM head and attention stay in bf16 / fp32.

``_scaled_mm`` needs inner dimensions that are multiples of 16; torchao pads the others (``pad_inner_dim``,
set here), e.g. the token count that is the inner dimension of the weight-gradient matmul.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec


def hardware_fp8() -> bool:
    """True on a CUDA device with FP8 tensor cores (compute capability >= 8.9)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def float8_config(recipe: str, emulate: bool | None = None):
    """torchao ``Float8LinearConfig`` for a recipe name (``tensorwise`` | ``rowwise``)."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as e:
        raise RuntimeError("model.fp8=torchao needs torchao: pip install -e '.[fp8]'") from e
    if recipe not in ("tensorwise", "rowwise"):
        raise ValueError(f"model.fp8=torchao supports fp8_recipe tensorwise or rowwise, not {recipe!r} "
                         f"(delayed scaling is Transformer Engine's: model.fp8=te)")
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(cfg, emulate=not hardware_fp8() if emulate is None else emulate, pad_inner_dim=True)


class _Float8Matmul:
    """y = x W^T (+ b) through torchao's float8 autograd function (not a module: holds no parameters)."""

    def __init__(self, in_features: int, out_features: int, recipe: str):
        from torchao.float8.float8_linear import Float8Linear  # gated: the optional [fp8] extra

        self.config = float8_config(recipe)
        with torch.device("meta"):     # only for its matmul configuration; its meta weight is never used
            self.linear_mm_config = Float8Linear(in_features, out_features, bias=False,
                                                 config=self.config).linear_mm_config

    def __call__(self, input, weight, bias=None):
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # gated: the [fp8] extra

        device = input.device.type
        if torch.is_autocast_enabled(device):
            input = input.to(torch.get_autocast_dtype(device))
        out = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.linear_mm_config, self.config)
        return out if bias is None else out + bias.to(out.dtype)


def _check_tp1(layer):
    if layer.config.tensor_model_parallel_size > 1:
        raise ValueError("model.fp8=torchao runs with tensor_model_parallel_size=1 only (TP communication lives "
                         "in the matmul it replaces); use model.fp8=te with Transformer Engine for TP > 1")


class _Float8Matmuls:
    """Mixin for megatron-core's parallel linears (TP = 1): the layer's matmul runs in float8."""

    def __init__(self, *args, fp8_recipe: str = "tensorwise", **kwargs):
        super().__init__(*args, **kwargs)
        _check_tp1(self)
        self._fp8 = _Float8Matmul(self.input_size, self.output_size, fp8_recipe)

    def _forward_impl(self, input, weight, bias=None, *args, **kwargs):
        return self._fp8(input, weight, bias)


class Float8ColumnParallelLinear(_Float8Matmuls, ColumnParallelLinear):
    """megatron-core ``ColumnParallelLinear`` (TP = 1) whose matmul runs in float8."""


class Float8RowParallelLinear(_Float8Matmuls, RowParallelLinear):
    """megatron-core ``RowParallelLinear`` (TP = 1) whose matmul runs in float8."""


def float8_linear_specs(spec, recipe: str):
    """Swap the local layer spec's linear layers for the float8 ones, in place."""
    float8_config(recipe)          # fail early: torchao missing, or a recipe it does not have
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    col = ModuleSpec(module=Float8ColumnParallelLinear, params={"fp8_recipe": recipe})
    row = ModuleSpec(module=Float8RowParallelLinear, params={"fp8_recipe": recipe})
    attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2 = col, row, col, row
    return spec


def float8_layers(model) -> list:
    """The float8 linear layers of a model (to check that the spec took effect)."""
    return [m for m in model.modules() if isinstance(m, (Float8ColumnParallelLinear, Float8RowParallelLinear))]


__all__ = ["Float8ColumnParallelLinear", "Float8RowParallelLinear",
           "float8_linear_specs", "float8_config", "float8_layers", "hardware_fp8"]
