"""The project's own Hugging Face format (the export every engine decodes): the name and layout mapping
(:data:`RULES`, transformers' decoder layout of :mod:`.adapters.layout`, read in both directions, with the
padded vocabulary rows kept), ``config.json``, reading an export (the conversions that write one, or a
native checkpoint from one, are in :mod:`.convert`; it is one of the adapters of :mod:`.adapters`).

Name and layout mapping (single-process state dict -> transformers names; ``i`` = layer):

    embedding.word_embeddings.weight                 model.model.embed_tokens.weight       (padded rows kept)
    decoder.layers.i.input_layernorm.{weight,bias}   model.model.layers.i.input_layernorm.*
    decoder.layers.i.self_attention.linear_qkv.*     ...self_attn.{q,k,v}_proj.*   (see below)
    decoder.layers.i.self_attention.linear_proj.*    ...self_attn.o_proj.*
    decoder.layers.i.self_attention.{q,k}_layernorm.* ...self_attn.{q,k}_norm.*   (qk_layernorm)
    decoder.layers.i.pre_mlp_layernorm.*             ...post_attention_layernorm.*
    decoder.layers.i.mlp.linear_fc1.*                ...mlp.up_proj.*   (SwiGLU: rows [gate ; up])
    decoder.layers.i.mlp.linear_fc2.*                ...mlp.down_proj.*
    decoder.final_layernorm.*                        model.model.norm.*
    output_layer.{weight,bias}                       lm_head.{weight,bias}   (tied: lm_head_bias)

megatron-core stores q, k, v fused and grouped by KV head: rows ``[G, (h/G + 2) * d]`` hold, for each
group g, its h/G query heads, then its key head, then its value head. Export splits that into the
three projections; import re-fuses them. Both directions only move rows, so export -> import is
bit-identical. The exported directory also carries the tokenizer (``tokenizer.json`` plus
``tokenizer_config.json`` with the special tokens, so ``AutoTokenizer`` works), the modelling code
(``setdiff_mega/hfmodel`` and ``setdiff_mega/decoding``, flattened: the model, its ``generate`` and the
samplers, and the CPU decode kernels' C++ source; ``auto_map`` points AutoModel at it) and, in
``config.json``, the training method and the full RunConfig.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from setdiff_mega.config import from_dict, to_dict
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.hfmodel.integrity import verify_checksums, write_checksums

from .adapters import layout
from .adapters.weights import HFWeights
from .io import CheckpointError

CODE_DIRS = tuple(Path(__file__).resolve().parent.parent / d for d in ("decoding", "hfmodel"))   # in every export
CODE_SUFFIXES = (".py", ".cpp")      # the modules, and the C++ source of hfmodel/cpu_kernels.py


def code_files() -> list:
    """The remote code of an export: every module of ``setdiff_mega/decoding`` and ``setdiff_mega/hfmodel`` but
    their ``__init__``, and the C++ source of the CPU decode kernels (``hfmodel/cpu_kernels.cpp``: the export's
    ``from_pretrained`` hands its copy to ``cpu_kernels``), in one flat directory (the names are unique)."""
    return sorted((p for d in CODE_DIRS for p in d.iterdir() if p.suffix in CODE_SUFFIXES and p.name != "__init__.py"),
                  key=lambda p: p.name)


def export_source(path: Path) -> str:
    """A code file as the export holds it: in a module, imports of ``..decoding.x`` become ``.x`` (one flat
    directory, which is what transformers' remote-code loader copies); other files unchanged."""
    text = Path(path).read_text()
    if Path(path).suffix != ".py":
        return text
    return re.sub(r"^(\s*)from \.\.decoding\.", r"\1from .", text, flags=re.M)


MODEL_TYPE = "setdlm"                  # transformers' model_type of every export (any objective)
AUTO_MAP = {"AutoConfig": "configuration_setdlm.SetDLMConfig",
            "AutoModel": "modeling_setdlm.SetDLMForDiffusionLM",
            "AutoModelForCausalLM": "modeling_setdlm.SetDLMForDiffusionLM",
            "AutoModelForMaskedLM": "modeling_setdlm.SetDLMForDiffusionLM"}
RULES = layout.DECODER_RULES           # transformers' decoder layout; the padded vocabulary rows are kept
def native_to_hf(state: dict, mc) -> dict:
    """Single-process native state dict -> the export's names (tensors only), by :data:`RULES`."""
    return layout.native_to_hf(state, mc, RULES)


def hf_config(cfg, tok, padded_vocab: int) -> dict:
    mc, oc = cfg.model, cfg.objective
    return {
        "architectures": ["SetDLMForDiffusionLM"], "model_type": MODEL_TYPE, "auto_map": AUTO_MAP,
        "vocab_size": padded_vocab, "tokenizer_vocab_size": mc.vocab_size or tok.vocab_size,
        "hidden_size": mc.hidden_size, "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": mc.query_groups,
        "intermediate_size": mc.ffn_size, "hidden_act": mc.activation, "head_dim": mc.head_dim,
        "normalization": mc.normalization, "norm_eps": mc.norm_eps, "norm_bias": mc.norm_bias,
        "qk_norm": mc.qk_layernorm, "attention_bias": mc.add_bias_linear, "qkv_bias": mc.qkv_has_bias,
        "mlp_bias": mc.mlp_has_bias, "rotary_scaling": mc.rope_scaling_parameters(),
        "head_bias": mc.head_bias, "shift_logits": mc.shift_logits, "tie_word_embeddings": mc.tie_embeddings,
        "rope_theta": float(mc.rotary_base),
        "rotary_percent": mc.rotary_percent, "max_position_embeddings": mc.max_position_embeddings,
        "bos_token_id": tok.bos, "eos_token_id": tok.eos, "pad_token_id": tok.pad, "mask_token_id": tok.mask,
        "torch_dtype": "float32",
        "method": {"objective": oc.name, "causal": oc.method.causal, "block": oc.method.block,
                   "sampler": oc.method.sampler.rpartition(":")[2], **oc.options.export_record(),
                   "mask_token_id": tok.mask, "bos_token_id": tok.bos, "eos_token_id": tok.eos,
                   "pad_token_id": tok.pad, "seq_length": cfg.data.seq_length},
        "setdiff_mega": to_dict(cfg),
    }


def is_hf_export(path: Path) -> bool:
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("model_type") == MODEL_TYPE
    except json.JSONDecodeError:
        raise CheckpointError(f"'{f}' is not valid JSON") from None


def export_weights(path: Path) -> str:
    """Which weights an export holds: "ema" or "raw" (exports before EMA existed: raw)."""
    return json.loads((Path(path) / "config.json").read_text()).get("setdiff_mega_weights", "raw")


def check_checksums(path: str | Path) -> None:
    """Every file of an export against its ``SHA256SUMS`` (exports before checksums: nothing to check)."""
    p = Path(path)
    problem = verify_checksums(lambda name: p / name if (p / name).is_file() else None)
    if problem:
        raise CheckpointError(f"export '{p}': {problem}")


def read_export(path: str | Path):
    """(RunConfig, Tokenizer, weights) of an exported directory (structure only: :func:`load_into` checks the
    shapes, :func:`check_checksums` the contents)."""
    p = Path(path)
    meta = json.loads((p / "config.json").read_text())
    if not meta.get("setdiff_mega"):
        raise CheckpointError(f"'{p / 'config.json'}' lacks the 'setdiff_mega' training config; it was not "
                              f"written by tools/convert_checkpoint.py")
    cfg = from_dict(meta["setdiff_mega"])
    f = p / "model.safetensors"
    if not f.is_file():
        raise CheckpointError(f"'{f}' is missing")
    weights = HFWeights(p)
    if not (p / "tokenizer.json").is_file():
        raise CheckpointError(f"export '{p}' has no tokenizer.json (every export carries the tokenizer its model "
                              f"was trained with): the copy is incomplete; copy the whole directory again")
    try:
        tok = Tokenizer.from_file(p / "tokenizer.json")
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"'{p / 'tokenizer.json'}': {e}") from None
    return cfg, tok, weights


def load_into(model, weights: HFWeights, path: Path, mc) -> None:
    """Load exported ``weights`` into a single-process native model built from ModelConfig ``mc``."""
    state = model.state_dict()
    expected = layout.expected_shapes(state, mc, RULES)
    layout.check_tensors(weights.shapes, expected, f"'{Path(path) / 'model.safetensors'}'")
    layout.fill_native(weights.get, state, mc, RULES)
    weights.close()


__all__ = ["CODE_DIRS", "code_files", "export_source", "check_checksums", "write_checksums", "RULES",
           "export_weights", "read_export", "is_hf_export", "native_to_hf", "hf_config", "load_into"]
