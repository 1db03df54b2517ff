"""What an architecture adapter is, and the parts the decoder-only families share.

An :class:`Adapter` is a record: the ``model_type`` / ``architectures`` values of ``config.json`` it reads
(``claims`` decides between adapters that share a ``model_type``, from the tensor names), ``to_model``
(the config's fields and the tensors' shapes -> ModelConfig fields), ``objective`` (the config -> the
objective overrides of a diffusion release), ``fold`` (a view of the weights with what the native model
does not have folded in), ``to_hf`` (ModelConfig -> the family's own ``config.json`` fields, for
``to-hf --format hf``), the name / shape map (:mod:`.layout`) and the tokens it takes as MASK when the
tokenizer has none. ``config.json`` is read through transformers' own config
class for the ``model_type`` (its defaults and its normalisation of RoPE fields: ``rope_parameters``, or
the older ``rope_theta`` / ``rope_scaling``); no remote code is ever executed.

The Llama-style families (Llama, Mistral, Qwen2, Qwen3) share :func:`decoder_fields`: RMSNorm, SwiGLU
(``hidden_act`` silu), RoPE with the base (and Llama 3 scaling) of the config, GQA, ``head_dim``, tied or
untied embeddings, no head bias.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from setdiff_mega import methods
from setdiff_mega.errors import CheckpointError

from .layout import DECODER_RULES


@dataclass(frozen=True)
class Adapter:
    name: str                               # recorded as model.family
    model_types: tuple                      # config.json "model_type" values
    architectures: tuple                    # config.json "architectures" values (the AR class for --format hf)
    to_model: Callable                      # (config dict, source, {name: shape}) -> ModelConfig fields
    to_hf: Callable | None = None           # RunConfig -> config.json fields (None: no --format hf)
    any_objective: bool = False             # its layout carries a diffusion method (else: AR models only)
    rules: tuple = DECODER_RULES
    exact_vocab: bool = True                # the file holds model.vocab_size rows (no native padding)
    mask_tokens: tuple = ()                 # existing tokens taken as MASK, first found wins
    transformers_config: bool = True        # config.json is read through transformers' class for model_type
    native: bool = False                    # the project's own export (its config is the whole training config)
    ignore: tuple = field(default=(r".*rotary_emb\.inv_freq",))   # buffers some writers save; never read
    claims: Callable | None = None          # (config dict, tensor names) -> bool, among a shared model_type
    objective: Callable | None = None       # config dict -> objective overrides (a diffusion release's method)
    fold: Callable = lambda weights: weights   # the weights as the native model reads them


@contextlib.contextmanager
def quiet_transformers():
    """transformers' config classes log advice users of an import cannot act on (RoPE field checks)."""
    from transformers.utils import logging as hf_logging  # optional dependency of the Hugging Face path

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def normalised(raw: dict) -> dict:
    """``config.json`` with transformers' defaults for its ``model_type`` filled in (its own config class)."""
    from transformers import AutoConfig

    with quiet_transformers():
        return AutoConfig.for_model(**raw).to_dict()


def rope_fields(hf: dict, source: str) -> dict:
    """ModelConfig's RoPE fields from a normalised config (``rope_parameters``)."""
    params = dict(hf.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rotary_base": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
           "rotary_percent": float(hf.get("partial_rotary_factor", 1.0) or 1.0)}
    if kind == "llama3":
        out.update(rope_scaling="llama3", rope_scaling_factor=float(params["factor"]),
                   rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_positions=int(params["original_max_position_embeddings"]))
    elif kind != "default":
        raise CheckpointError(f"{source}: RoPE scaling '{kind}' is not supported (none or llama3); import the model "
                              f"without it, or convert its weights with a tool that folds the scaling in")
    return out


def decoder_fields(hf: dict, source: str, family: str) -> dict:
    """ModelConfig fields shared by the Llama-style families (see the module docstring)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act '{act}' is not supported for {family} (silu, i.e. SwiGLU)")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    return {"family": family, "num_layers": int(hf["num_hidden_layers"]), "hidden_size": hidden,
            "num_attention_heads": heads, "num_query_groups": int(hf.get("num_key_value_heads") or heads),
            "ffn_hidden_size": int(hf["intermediate_size"]),
            "kv_channels": None if head_dim * heads == hidden else head_dim,
            "normalization": "RMSNorm", "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "activation": "swiglu",
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "head_bias": False,
            "zero_init_head": False, "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)),
            **rope_fields(hf, source)}


def decoder_hf_fields(mc) -> dict:
    """The Llama-style ``config.json`` fields of a ModelConfig (the inverse of :func:`decoder_fields`)."""
    rope = {"rope_type": "default", "rope_theta": float(mc.rotary_base)}
    if mc.rope_scaling:
        rope = {**mc.rope_scaling_parameters(), "rope_theta": float(mc.rotary_base)}
    return {"vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size, "intermediate_size": mc.ffn_size,
            "num_hidden_layers": mc.num_layers, "num_attention_heads": mc.num_attention_heads,
            "num_key_value_heads": mc.query_groups, "head_dim": mc.head_dim, "hidden_act": "silu",
            "max_position_embeddings": mc.max_position_embeddings, "rms_norm_eps": mc.norm_eps,
            "tie_word_embeddings": mc.tie_embeddings, "rope_parameters": rope}


def release_objective(raw: dict) -> list:
    """The objective overrides of a setdlms / bd3lms / mdlm release's ``config.json``:
    ``noise_config.desired_block_size`` -> SetDLM with D = it and S_max = ``max_block_size``, except that some
    exported configs carry ``max_block_size == length`` where 2D was meant (the reference's loader warns about
    it): then S_max = 2D; ``model_type`` mdlm -> MDLM; else BD3LM with the config's ``block_size``."""
    noise, length = raw.get("noise_config") or {}, raw.get("length", raw.get("model_length"))
    if noise.get("desired_block_size"):
        D = int(noise["desired_block_size"])
        s_max = noise.get("max_block_size")
        if s_max is None or s_max == length or s_max == noise.get("length"):
            s_max = 2 * D                      # the reference loader's warning: max_block_size == length
        return ["objective.name=setdlm", f"objective.D={D}", f"objective.S_max={int(s_max)}"]
    name = raw.get("model_type")               # the release's model_type is its method (bd3lm, mdlm)
    if name not in methods.names():
        raise CheckpointError(f"config.json's model_type '{name}' names no method of this project "
                              f"({', '.join(methods.names())})")
    options = {f.name for f in dataclasses.fields(methods.get(name).options)}
    block = [f"objective.block_size={int(raw['block_size'])}"] if "block_size" in options and raw.get("block_size") \
        else []
    return [f"objective.name={name}", *block]


def refuse(condition: bool, source: str, what: str) -> None:
    if condition:
        raise CheckpointError(f"{source}: {what}")


__all__ = ["Adapter", "release_objective", "normalised", "rope_fields", "decoder_fields", "decoder_hf_fields", "refuse",
           "quiet_transformers"]
