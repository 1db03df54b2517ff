"""The diffusion-agnostic transformer on megatron-core. On a CPU-only machine the megatron-core shim
(:mod:`setdiff_mega.compat.mcore_cpu`) must be applied first; the entry points and
``setdiff_mega.parallel.initialize`` do that."""
from .transformer import SetDiffusionTransformer, build_model, padded_vocab_size, transformer_config

__all__ = ["SetDiffusionTransformer", "build_model", "transformer_config", "padded_vocab_size"]
