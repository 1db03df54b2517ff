"""The set-diffusion transformer on megatron-core. It knows nothing about diffusion.

    logits = model(tokens [B, T], position_ids [B, T], attention_mask [1|B, T, T] (bool, True = allowed),
                   logits_start=s, attention_pattern=None)  ->  [B, T - s, V]

``attention_pattern`` (optional) names the mask's structure (causal, full, two-stream block / set-causal,
key padding; :class:`setdiff_mega.diffusion.masks.MaskPattern`). It rides on the mask tensor handed to
megatron-core (attribute ``attention_pattern``), so each core attention sees exactly the mask it describes;
backends that can (FlexAttention, the set-causal decomposition, SDPA's causal kernel) use it instead of
the dense mask. Given a pattern, ``attention_mask`` may be None: the layers then get a placeholder
carrying the pattern (:func:`~setdiff_mega.model.attention.lazy_mask`), and only a core attention that
needs the dense mask builds it, once per pattern (the local mcore attention gets the dense mask).

* Embedding: mcore ``LanguageModelEmbedding`` (vocab-parallel, no learned positions).
* Positions: RoPE at the given per-sample ``position_ids`` (:mod:`.rope`); SetDLM passes the original
  positions of its permuted tokens, inference passes absolute positions.
* Body: mcore ``TransformerBlock`` built from the layer spec (:mod:`.spec`), pre-norm, final norm.
* Head: a ``ColumnParallelLinear`` evaluated only on ``hidden[logits_start:]`` (the noisy half of a
  2L input needs logits, the clean half does not), untied, with bias and zero init by default (DiT
  head), or tied to the embedding (under PP > 1 the last stage holds a synchronised copy: :mod:`.tied`).
  The embedding and head are padded to a multiple of ``make_vocab_size_divisible_by`` (x TP); logits are
  sliced back to the real vocabulary.

Internally megatron-core works sequence-first ([T, B, H]) with masks in its own convention
(True = masked out); the conversion happens here and nowhere else. ``pre_process`` /
``post_process`` select the first / last pipeline stage.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from setdiff_mega import backends

from .attention import SDPACoreAttention, lazy_mask
from .rope import PerSampleRotary
from .spec import Norm, block_spec, layer_spec
from .tied import mark_stage_weights, sync_tied_copies, tie_checkpoint_entry


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Round up to a multiple of lcm(divisible_by, tp): every TP rank gets an equal vocab shard, and the
    padded size (hence the initial weights) is the same for every TP size that divides divisible_by."""
    multiple = math.lcm(max(1, divisible_by), max(1, tp))
    return ((vocab_size + multiple - 1) // multiple) * multiple


ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "swiglu": F.silu}


def transformer_config(mc, *, precision: str = "fp32", tp: int = 1, pp: int = 1,
                       sequence_parallel: bool = False, vp: int | None = None,
                       initialize: bool = True) -> TransformerConfig:
    """megatron-core TransformerConfig from a :class:`setdiff_mega.config.ModelConfig`; ``initialize=False``
    leaves the weights uninitialised (megatron-core's ``perform_initialization``: every one is about to be
    loaded, and the fp32 master copies of the initialisation would cost memory)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    swiglu = mc.activation == "swiglu"
    return TransformerConfig(
        num_layers=mc.num_layers, hidden_size=mc.hidden_size, num_attention_heads=mc.num_attention_heads,
        num_query_groups=mc.num_query_groups, ffn_hidden_size=mc.ffn_size, kv_channels=mc.head_dim,
        hidden_dropout=mc.hidden_dropout, attention_dropout=mc.attention_dropout,
        init_method_std=mc.init_method_std, add_bias_linear=mc.add_bias_linear, add_qkv_bias=mc.add_qkv_bias,
        gated_linear_unit=swiglu, activation_func=ACTIVATIONS[mc.activation], qk_layernorm=mc.qk_layernorm,
        normalization=mc.normalization, layernorm_epsilon=mc.norm_eps,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=initialize,
        params_dtype=dtype, bf16=precision == "bf16", pipeline_dtype=dtype,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel and tp > 1,
        virtual_pipeline_model_parallel_size=vp,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        recompute_granularity=mc.recompute_granularity, recompute_method=mc.recompute_method,
        recompute_num_layers=mc.recompute_num_layers,
        **({"fp8": "hybrid", "fp8_recipe": mc.fp8_recipe} if getattr(mc, "fp8", "none") == "te" else {}),
    )


class SetDiffusionTransformer(MegatronModule):
    """Transformer LM with per-sample RoPE positions, arbitrary masks and a sliced LM head."""

    def __init__(self, config: TransformerConfig, vocab_size: int, *, spec=None,
                 make_vocab_size_divisible_by: int = 128, max_position_embeddings: int = 4096,
                 rotary_base: float = 10000.0, rotary_percent: float = 1.0, rope_scaling: dict | None = None,
                 head_bias: bool = True, zero_init_head: bool = True, tie_embeddings: bool = False,
                 pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
        super().__init__(config=config)
        if spec is None:
            spec, _ = layer_spec("auto", backends.DEFAULT, config.normalization)
        self.attention_backend = backends.DEFAULT   # the backend record's name (build_model sets the config's)
        self.vocab_size = int(vocab_size)
        self.padded_vocab_size = padded_vocab_size(vocab_size, make_vocab_size_divisible_by,
                                                   config.tensor_model_parallel_size)
        self.pre_process, self.post_process = pre_process, post_process
        self.model_type = ModelType.encoder_or_decoder      # read by mcore's pipeline schedules
        self.tie_embeddings = tie_embeddings
        self.share_embeddings_and_output_weights = tie_embeddings
        if pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size=self.padded_vocab_size,
                                                    max_sequence_length=max_position_embeddings,
                                                    position_embedding_type="rope",
                                                    scatter_to_sequence_parallel=True)
        self.rope = PerSampleRotary(config.kv_channels, rotary_percent, rotary_base,
                                    initial_positions=max_position_embeddings, scaling=rope_scaling)
        self.vp_stage = vp_stage
        self.decoder = TransformerBlock(config=config, spec=spec, pre_process=pre_process,
                                        post_process=post_process, vp_stage=vp_stage)
        if post_process:
            init = (lambda w: torch.nn.init.zeros_(w)) if zero_init_head and not tie_embeddings \
                else config.init_method
            # the head sees the full (gathered) sequence even under sequence parallelism
            head_config = dataclasses.replace(config, sequence_parallel=False) if config.sequence_parallel else config
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, config=head_config, init_method=init,
                bias=head_bias, skip_bias_add=False, gather_output=True,
                skip_weight_param_allocation=tie_embeddings and pre_process)   # PP > 1: the last stage's copy
        mark_stage_weights(self)                                             # (tied.py)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline stages > 0 receive their input here (mcore schedule protocol)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    @property
    def lazy_masks(self) -> bool:
        """True if every core attention of this chunk takes a pattern placeholder for the dense mask."""
        if not hasattr(self, "_lazy_masks"):
            self._lazy_masks = all(isinstance(layer.self_attention.core_attention, SDPACoreAttention)
                                   for layer in self.decoder.layers)
        return self._lazy_masks

    @staticmethod
    def to_mcore_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """True = allowed [1|B, T, T] -> mcore's True = masked out [1|B, 1, T, T]."""
        if attention_mask is None:
            return None
        if attention_mask.dim() == 3:
            attention_mask = attention_mask.unsqueeze(1)
        return ~attention_mask.bool()

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, logits_start: int = 0, attention_pattern=None) -> torch.Tensor:
        hidden = self.embedding(input_ids=tokens, position_ids=position_ids) if self.pre_process else None
        freqs = self.rope(position_ids)
        if attention_mask is None and attention_pattern is not None and self.lazy_masks:
            mask = lazy_mask(attention_pattern, position_ids.device)    # built by the core attention if needed
        else:
            if attention_mask is None and attention_pattern is not None:
                attention_mask = attention_pattern.dense(position_ids.device)
            mask = self.to_mcore_mask(attention_mask)
            if mask is not None and attention_pattern is not None:
                mask.attention_pattern = attention_pattern
        hidden = self.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=freqs)
        if not self.post_process:
            return hidden
        if self.config.sequence_parallel:
            # sequence shards -> full sequence; the head's input copy all-reduces the gradient already, so the
            # backward of this gather only splits it (tensor_parallel_output_grad=False)
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return self.logits(hidden[logits_start:])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, B, H] -> logits [B, N, V] over the real vocabulary."""
        weight = self.embedding.word_embeddings.weight if self.tie_embeddings and self.pre_process else None
        out, _ = self.output_layer(hidden, weight=weight)
        return out.transpose(0, 1)[..., : self.vocab_size]

    def cache_shape(self) -> tuple[int, int, int]:
        """(local layers, KV groups per TP rank, head dim) for building a KV cache."""
        tp = self.config.tensor_model_parallel_size
        groups = (self.config.num_query_groups or self.config.num_attention_heads) // tp
        return len(self.decoder.layers), groups, self.config.kv_channels

    @contextlib.contextmanager
    def use_cache(self, cache):
        """Route every layer's core attention through ``cache`` (decoding); needs a backend whose record has
        ``kv_cache`` (and its core attention, i.e. not the Transformer Engine spec's own)."""
        cores = [layer.self_attention.core_attention for layer in self.decoder.layers]
        if not backends.get(self.attention_backend).kv_cache:
            able = ", ".join(n for n in backends.names() if backends.get(n).kv_cache)
            raise RuntimeError(f"KV-cached decoding needs a model.attention_backend with a KV cache ({able}); "
                               f"model.attention_backend={self.attention_backend} has none: rebuild the model with "
                               f"one of them (the weights are the same)")
        for i, c in enumerate(cores):
            c.kv_cache, c.cache_layer = cache, i
        try:
            yield cache
        finally:
            for c in cores:
                c.kv_cache = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron-core's, with a last stage's copy of a tied embedding stored as its replica (tied.py)."""
        ssd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return tie_checkpoint_entry(self, ssd, prefix, metadata)

    def load_sharded_state(self, state: dict) -> None:
        """Inverse of ``sharded_state_dict()`` once a checkpoint has filled it in."""
        self.load_state_dict(state)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters() if not getattr(p, "shared", False))
        if exclude_embeddings and self.pre_process:
            n -= self.embedding.word_embeddings.weight.numel()
        return n


class ModelChunks(torch.nn.ModuleList):
    """The V model chunks one rank holds under interleaved pipeline parallelism (virtual stages).

    Chunk v of pipeline rank r holds global layers ``(v * PP + r) * n + [0, n)`` (n = layers / (PP x V)); the
    embedding sits in chunk 0 of rank 0 and the head in chunk V-1 of the last rank. megatron-core's
    interleaved schedule runs the list; parameters, gradients and checkpoints see all chunks (each chunk's
    sharded state dict uses global layer indices, so the checkpoint is the same as any other layout's).
    """

    def __init__(self, chunks):
        super().__init__(chunks)
        first = chunks[0]
        self.config, self.vocab_size, self.padded_vocab_size = first.config, first.vocab_size, first.padded_vocab_size
        self.pre_process = any(c.pre_process for c in chunks)
        self.post_process = any(c.post_process for c in chunks)

    @property
    def chunks(self) -> list:
        return list(self)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return {f"chunk{i}": c.sharded_state_dict(prefix, sharded_offsets, metadata) for i, c in enumerate(self)}

    def load_sharded_state(self, state: dict) -> None:
        for i, c in enumerate(self):
            c.load_state_dict(state[f"chunk{i}"])


def model_chunks(model) -> list:
    """The list of modules a pipeline schedule runs: the chunks, or the model itself."""
    return model.chunks if isinstance(model, ModelChunks) else [model]


def build_model(mc, vocab_size: int, *, precision: str = "fp32", pre_process: bool | None = None,
                post_process: bool | None = None, sequence_parallel: bool = False, initialize: bool = True):
    """Build this rank's part of the model (its TP shard and PP stage, or its V chunks under interleaved
    pipeline parallelism: a :class:`ModelChunks`); mcore's parallel state must be set. ``initialize=False``:
    uninitialised weights, for a caller that loads every tensor next."""
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    vp = ps.get_virtual_pipeline_model_parallel_world_size()
    cfg = transformer_config(mc, precision=precision, tp=tp, pp=pp, sequence_parallel=sequence_parallel, vp=vp,
                             initialize=initialize)
    sp = sequence_parallel and tp > 1
    spec, impl = layer_spec(mc.transformer_impl, mc.attention_backend, mc.normalization, sequence_parallel=sp,
                            fp8=mc.fp8, fp8_recipe=mc.fp8_recipe, qk_layernorm=mc.qk_layernorm,
                            norm_bias=mc.norm_bias,
                            mlp_bias=None if mc.mlp_has_bias == mc.add_bias_linear else mc.mlp_has_bias)
    if mc.fp8 == "te" and impl != "transformer_engine":
        raise RuntimeError("model.fp8=te needs Transformer Engine on a CUDA GPU (pip install -e '.[gpu]'); "
                           "without it use model.fp8=torchao")
    if impl == "local":
        spec = block_spec(spec, cfg.num_layers // (pp * (vp or 1)), ModuleSpec(module=Norm,
                                                                                params={"bias": mc.norm_bias}))

    def chunk(vp_stage):
        pre = ps.is_pipeline_first_stage(ignore_virtual=vp is None, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=vp is None, vp_stage=vp_stage)
        model = SetDiffusionTransformer(
            cfg, vocab_size, spec=spec, make_vocab_size_divisible_by=mc.make_vocab_size_divisible_by,
            max_position_embeddings=mc.max_position_embeddings, rotary_base=mc.rotary_base,
            rotary_percent=mc.rotary_percent, rope_scaling=mc.rope_scaling_parameters(), head_bias=mc.head_bias,
            zero_init_head=mc.zero_init_head,
            tie_embeddings=mc.tie_embeddings, pre_process=pre if pre_process is None else pre_process,
            post_process=post if post_process is None else post_process, vp_stage=vp_stage)
        model.attention_backend = mc.attention_backend
        return model.cuda() if torch.cuda.is_available() else model

    model = chunk(None) if vp is None else ModelChunks([chunk(v) for v in range(vp)])
    if mc.tie_embeddings and pp > 1:
        sync_tied_copies(model_chunks(model))          # the last stage's copy of the embedding := the embedding
    return model


__all__ = ["SetDiffusionTransformer", "ModelChunks", "model_chunks", "build_model", "transformer_config",
           "padded_vocab_size"]
