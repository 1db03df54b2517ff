"""The Hugging Face format: the name and layout mapping (one declarative table, :data:`RULES`, read in
both directions), ``config.json``, reading an export (the conversions that write one, or a native
checkpoint from one, are in :mod:`.convert`).

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
samplers; ``auto_map`` points AutoModel
at it) and, in ``config.json``, the training method and the full RunConfig.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from setdiff_mega.config import from_dict, to_dict
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.hfmodel.integrity import verify_checksums, write_checksums

from .io import CheckpointError

CODE_DIRS = tuple(Path(__file__).resolve().parent.parent / d for d in ("decoding", "hfmodel"))   # in every export


def code_files() -> list:
    """The remote code of an export: every module of ``setdiff_mega/decoding`` and ``setdiff_mega/hfmodel`` but
    their ``__init__`` (one flat directory in the export: the names are unique)."""
    return sorted((p for d in CODE_DIRS for p in d.glob("*.py") if p.name != "__init__.py"), key=lambda p: p.name)


def export_source(path: Path) -> str:
    """A code file as the export holds it: imports of ``..decoding.x`` become ``.x`` (one flat directory,
    which is what transformers' remote-code loader copies)."""
    return re.sub(r"^(\s*)from \.\.decoding\.", r"\1from .", Path(path).read_text(), flags=re.M)


MODEL_TYPE = "setdlm"                  # transformers' model_type of every export (any objective)
AUTO_MAP = {"AutoConfig": "configuration_setdlm.SetDLMConfig",
            "AutoModel": "modeling_setdlm.SetDLMForDiffusionLM",
            "AutoModelForCausalLM": "modeling_setdlm.SetDLMForDiffusionLM",
            "AutoModelForMaskedLM": "modeling_setdlm.SetDLMForDiffusionLM"}
def _qkv_split(t: torch.Tensor, mc) -> tuple:
    heads, groups = mc.num_attention_heads, mc.query_groups
    per = heads // groups
    d = t.shape[0] // (groups * (per + 2))
    g = t.reshape(groups, (per + 2) * d, *t.shape[1:])
    q, k, v = torch.split(g, [per * d, d, d], dim=1)
    return tuple(x.reshape(-1, *t.shape[1:]).contiguous() for x in (q, k, v))


def _qkv_fuse(parts: tuple, mc) -> torch.Tensor:
    groups = mc.query_groups
    grouped = [x.reshape(groups, -1, *x.shape[1:]) for x in parts]
    return torch.cat(grouped, dim=1).reshape(-1, *parts[0].shape[1:]).contiguous()


@dataclass(frozen=True)
class Rule:
    """One native tensor <-> one or more transformers tensors. ``native`` is a regex over the native name
    (groups ``i`` = layer, ``kind`` = weight / bias), ``hf`` the transformers names it becomes (formatted
    with the groups); ``split`` / ``fuse`` move rows between the two layouts (exact inverses); ``when``
    selects the rule for a ModelConfig."""
    native: str
    hf: tuple
    split: Callable = lambda t, mc: (t,)
    fuse: Callable = lambda parts, mc: parts[0]
    when: Callable = lambda mc: True


_L = r"decoder\.layers\.(?P<i>\d+)\."
_K = r"\.(?P<kind>weight|bias)"
RULES = (
    Rule(r"embedding\.word_embeddings" + _K, ("model.embed_tokens.{kind}",)),
    Rule(r"decoder\.final_layernorm" + _K, ("model.norm.{kind}",)),
    Rule(r"output_layer\.bias", ("lm_head_bias",), when=lambda mc: mc.tie_embeddings),
    Rule(r"output_layer" + _K, ("lm_head.{kind}",)),
    Rule(_L + r"input_layernorm" + _K, ("model.layers.{i}.input_layernorm.{kind}",)),
    Rule(_L + r"pre_mlp_layernorm" + _K, ("model.layers.{i}.post_attention_layernorm.{kind}",)),
    Rule(_L + r"self_attention\.linear_qkv" + _K,
         tuple(f"model.layers.{{i}}.self_attn.{p}_proj.{{kind}}" for p in "qkv"), _qkv_split, _qkv_fuse),
    Rule(_L + r"self_attention\.linear_proj" + _K, ("model.layers.{i}.self_attn.o_proj.{kind}",)),
    Rule(_L + r"self_attention\.(?P<qk>[qk])_layernorm" + _K, ("model.layers.{i}.self_attn.{qk}_norm.{kind}",)),
    Rule(_L + r"mlp\.linear_fc1" + _K, ("model.layers.{i}.mlp.gate_proj.{kind}", "model.layers.{i}.mlp.up_proj.{kind}"),
         lambda t, mc: tuple(x.contiguous() for x in t.chunk(2, dim=0)), lambda parts, mc: torch.cat(parts),
         when=lambda mc: mc.activation == "swiglu"),
    Rule(_L + r"mlp\.linear_fc1" + _K, ("model.layers.{i}.mlp.up_proj.{kind}",)),
    Rule(_L + r"mlp\.linear_fc2" + _K, ("model.layers.{i}.mlp.down_proj.{kind}",)),
)


def _rule(name: str, mc) -> tuple:
    """(rule, the transformers names) of a native tensor name."""
    for r in RULES:
        m = re.fullmatch(r.native, name)
        if m and r.when(mc):
            return r, [h.format(**m.groupdict()) for h in r.hf]
    raise CheckpointError(f"no Hugging Face name for tensor '{name}' (unsupported model or layer variant)")


def _tensors(state: dict):
    return ((k, v) for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state"))


def native_to_hf(state: dict, mc) -> dict:
    """Single-process native state dict -> transformers names (tensors only), by :data:`RULES`."""
    out = {}
    for name, t in _tensors(state):
        rule, names = _rule(name, mc)
        out.update(zip(names, rule.split(t.detach().cpu().contiguous(), mc)))
    return out


def hf_to_native(weights: dict, template: dict, mc, source: str) -> dict:
    """transformers names -> the native state dict with the keys (and non-tensor entries) of ``template``,
    by the same :data:`RULES`."""
    expected = native_to_hf(template, mc)
    for k, v in expected.items():
        if k not in weights:
            raise CheckpointError(f"{source} has no tensor '{k}' (the config's architecture needs it)")
        if tuple(weights[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{source}: tensor '{k}' has shape {tuple(weights[k].shape)}, the config's "
                                  f"architecture needs {tuple(v.shape)}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise CheckpointError(f"{source} has tensors the config's architecture does not use: {extra[:4]}")
    out = dict(template)
    for name, _ in _tensors(template):
        rule, names = _rule(name, mc)
        out[name] = rule.fuse(tuple(weights[n] for n in names), mc)
    return out


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
        "head_bias": mc.head_bias, "tie_word_embeddings": mc.tie_embeddings, "rope_theta": float(mc.rotary_base),
        "rotary_percent": mc.rotary_percent, "max_position_embeddings": mc.max_position_embeddings,
        "bos_token_id": tok.bos, "eos_token_id": tok.eos, "pad_token_id": tok.pad, "mask_token_id": tok.mask,
        "torch_dtype": "float32",
        "method": {"objective": oc.name, "causal": oc.method.causal,
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
    try:
        weights = load_file(str(f))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"'{f}' is truncated or unreadable ({e})") from None
    if not (p / "tokenizer.json").is_file():
        raise CheckpointError(f"export '{p}' has no tokenizer.json (every export carries the tokenizer its model "
                              f"was trained with): the copy is incomplete; copy the whole directory again")
    try:
        tok = Tokenizer.from_file(p / "tokenizer.json")
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"'{p / 'tokenizer.json'}': {e}") from None
    return cfg, tok, weights


def load_into(model, weights: dict, path: Path, mc) -> None:
    """Load exported ``weights`` into a single-process native model built from ModelConfig ``mc``."""
    src = f"'{Path(path) / 'model.safetensors'}'"
    model.load_state_dict(hf_to_native(weights, model.state_dict(), mc, src))


__all__ = ["CODE_DIRS", "code_files", "export_source", "check_checksums", "write_checksums", "RULES", "Rule",
           "export_weights", "read_export", "is_hf_export", "native_to_hf", "hf_to_native", "hf_config", "load_into"]
