"""The diffusion-agnostic transformer on megatron-core (import applies the CPU shim when needed)."""
from . import mcore_cpu

mcore_cpu.apply()

from .transformer import SetDiffusionTransformer, build_model, padded_vocab_size, transformer_config  # noqa: E402

__all__ = ["SetDiffusionTransformer", "build_model", "transformer_config", "padded_vocab_size", "mcore_cpu"]
