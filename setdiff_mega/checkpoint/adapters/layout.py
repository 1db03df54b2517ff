"""Declarative name / shape maps between the native (megatron-core, single-process) state dict and a
Hugging Face layout, read in both directions (torchtitan's ``state_dict_adapter`` idea).

A :class:`Rule` maps one native tensor to one or more Hugging Face tensors: ``native`` is a regex over the
native name (groups ``i`` = layer, ``kind`` = weight / bias, any other named group is passed on), ``hf``
the names it becomes; ``split`` / ``fuse`` move rows between the layouts and are exact inverses, so a
round trip is bit-identical; ``when`` selects the rule for a ModelConfig; ``vocab`` marks the embedding
and head, whose rows the native model pads to a multiple of ``make_vocab_size_divisible_by`` (x TP): a
layout with ``exact_vocab`` holds ``model.vocab_size`` rows (the padding is sliced off on the way out and
zero rows added on the way in), the project's own export keeps the padded rows.

megatron-core stores q, k, v fused and grouped by KV head: ``linear_qkv`` rows ``[G, (h/G + 2) * d]`` hold,
for each group g, its h/G query heads, then its key head, then its value head (:func:`qkv_split` /
:func:`qkv_fuse`); SwiGLU's ``linear_fc1`` rows are ``[gate ; up]``.

:data:`DECODER_RULES` is the layout of transformers' decoder-only models (``model.embed_tokens``,
``model.layers.i.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head``),
shared by the Llama / Qwen2 / Qwen3 adapters and the project's export (whose GELU MLP has ``up_proj`` only,
and whose tied head may carry a bias, ``lm_head_bias``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from setdiff_mega.errors import CheckpointError


def qkv_split(t: torch.Tensor, mc) -> tuple:
    """megatron-core's grouped ``linear_qkv`` rows -> (q, k, v) rows (heads in order)."""
    heads, groups = mc.num_attention_heads, mc.query_groups
    per = heads // groups
    d = t.shape[0] // (groups * (per + 2))
    g = t.reshape(groups, (per + 2) * d, *t.shape[1:])
    q, k, v = torch.split(g, [per * d, d, d], dim=1)
    return tuple(x.reshape(-1, *t.shape[1:]).contiguous() for x in (q, k, v))


def qkv_fuse(parts: tuple, mc) -> torch.Tensor:
    """(q, k, v) rows -> megatron-core's grouped ``linear_qkv`` rows."""
    groups = mc.query_groups
    grouped = [x.reshape(groups, -1, *x.shape[1:]) for x in parts]
    return torch.cat(grouped, dim=1).reshape(-1, *parts[0].shape[1:]).contiguous()


def _same(t, mc):
    return (t,)


def _first(parts, mc):
    return parts[0]


@dataclass(frozen=True)
class Rule:
    """One native tensor <-> one or more Hugging Face tensors (see the module docstring)."""
    native: str
    hf: tuple
    split: Callable = _same
    fuse: Callable = _first
    when: Callable = lambda mc: True
    vocab: bool = False


_L = r"decoder\.layers\.(?P<i>\d+)\."
_K = r"\.(?P<kind>weight|bias)"
_HF = "model.layers.{i}."
DECODER_RULES = (
    Rule(r"embedding\.word_embeddings" + _K, ("model.embed_tokens.{kind}",), vocab=True),
    Rule(r"decoder\.final_layernorm" + _K, ("model.norm.{kind}",)),
    Rule(r"output_layer\.bias", ("lm_head_bias",), when=lambda mc: mc.tie_embeddings, vocab=True),
    Rule(r"output_layer" + _K, ("lm_head.{kind}",), vocab=True),
    Rule(_L + r"input_layernorm" + _K, (_HF + "input_layernorm.{kind}",)),
    Rule(_L + r"pre_mlp_layernorm" + _K, (_HF + "post_attention_layernorm.{kind}",)),
    Rule(_L + r"self_attention\.linear_qkv" + _K, tuple(_HF + f"self_attn.{p}_proj.{{kind}}" for p in "qkv"),
         qkv_split, qkv_fuse),
    Rule(_L + r"self_attention\.linear_proj" + _K, (_HF + "self_attn.o_proj.{kind}",)),
    Rule(_L + r"self_attention\.(?P<qk>[qk])_layernorm" + _K, (_HF + "self_attn.{qk}_norm.{kind}",)),
    Rule(_L + r"mlp\.linear_fc1" + _K, (_HF + "mlp.gate_proj.{kind}", _HF + "mlp.up_proj.{kind}"),
         lambda t, mc: tuple(x.contiguous() for x in t.chunk(2, dim=0)), lambda parts, mc: torch.cat(parts),
         when=lambda mc: mc.activation == "swiglu"),
    Rule(_L + r"mlp\.linear_fc1" + _K, (_HF + "mlp.up_proj.{kind}",)),
    Rule(_L + r"mlp\.linear_fc2" + _K, (_HF + "mlp.down_proj.{kind}",)),
)


def match(rules, name: str, mc) -> tuple:
    """(rule, the Hugging Face names) of a native tensor name."""
    for r in rules:
        m = re.fullmatch(r.native, name)
        if m and r.when(mc):
            return r, [h.format(**m.groupdict()) for h in r.hf]
    raise CheckpointError(f"no Hugging Face name for tensor '{name}' (unsupported model or layer variant)")


def tensors(state: dict):
    """The (name, tensor) pairs of a native state dict (no megatron-core ``_extra_state``)."""
    return ((k, v) for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state"))


def native_to_hf(state: dict, mc, rules=DECODER_RULES, exact_vocab: bool = False) -> dict:
    """Single-process native state dict -> Hugging Face names (tensors only)."""
    out = {}
    for name, t in tensors(state):
        rule, names = match(rules, name, mc)
        t = t.detach().cpu()
        if rule.vocab and exact_vocab:
            t = t[: mc.vocab_size]
        out.update(zip(names, rule.split(t.contiguous(), mc)))
    return out


def expected_shapes(template: dict, mc, rules=DECODER_RULES, exact_vocab: bool = False) -> dict:
    """Hugging Face name -> shape that a native ``template`` (a state dict, or one on the meta device) needs."""
    return {k: tuple(v.shape) for k, v in native_to_hf(template, mc, rules, exact_vocab).items()}


def check_tensors(shapes: dict, expected: dict, source: str, ignore=()) -> None:
    """Every expected tensor present with its shape, nothing else (but names matching ``ignore``)."""
    for k, v in expected.items():
        if k not in shapes:
            raise CheckpointError(f"{source} has no tensor '{k}' (the config's architecture needs it)")
        if tuple(shapes[k]) != tuple(v):
            raise CheckpointError(f"{source}: tensor '{k}' has shape {tuple(shapes[k])}, the config's "
                                  f"architecture needs {tuple(v)}")
    extra = sorted(k for k in set(shapes) - set(expected) if not any(re.fullmatch(p, k) for p in ignore))
    if extra:
        raise CheckpointError(f"{source} has tensors the config's architecture does not use: {extra[:4]}")


@torch.no_grad()
def fill_native(get: Callable, state: dict, mc, rules=DECODER_RULES, rank: Callable = lambda name: 0) -> None:
    """Copy Hugging Face tensors (``get(name)``; check them with :func:`check_tensors` first) into the
    tensors of a native ``state`` dict in place (a model's ``state_dict()`` aliases its parameters, so the
    model is filled without a second copy of it). Tensors are visited in the order ``rank`` gives their
    first Hugging Face name (the shard that holds it: each shard is read once). Vocabulary rows the source
    lacks (the native padding) become zero."""
    todo = [(name, *match(rules, name, mc)) for name, _ in tensors(state)]
    for name, rule, names in sorted(todo, key=lambda item: rank(item[2][0])):
        value = rule.fuse(tuple(get(n) for n in names), mc)
        target = state[name]
        rows = min(value.shape[0], target.shape[0]) if rule.vocab else target.shape[0]
        target[:rows].copy_(value[:rows])
        if rows < target.shape[0]:
            target[rows:].zero_()


__all__ = ["Rule", "DECODER_RULES", "qkv_split", "qkv_fuse", "match", "tensors", "native_to_hf",
           "expected_shapes", "check_tensors", "fill_native"]
