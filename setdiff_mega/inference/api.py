"""High-level generation: text requests -> batched canvas -> the objective's sampler -> text + stats.

Requests are strings or dicts:

* ``"Question: ..."``                 plain prompt, continued for ``max_new_tokens`` tokens;
* ``"A <|mask|><|mask|> B"``           infill: each ``<|mask|>`` is one position to fill;
* ``{"prefix": ..., "suffix": ..., "span": m}``  infill of m tokens between prefix and suffix,
  laid out as ``[BOS] prefix [MASK]*m suffix [EOS]`` (method.md 5.4).

Every request starts with BOS (as every training document does). The sampler follows the model's
training objective: setdlm -> :class:`SetDLMSampler`, ar -> :class:`ARSampler`, bd3lm ->
:class:`BD3LMSampler`, mdlm -> :class:`MDLMSampler`. Results carry the text, token counts, forward
passes (NFE), tokens per step and tokens/s (wall time includes the prefill).
"""
from __future__ import annotations

import time

import torch

from .base import Canvas, GenerationConfig
from .baselines import ARSampler, BD3LMSampler, MDLMSampler
from .setdlm import SetDLMSampler

SAMPLERS = {"setdlm": SetDLMSampler, "ar": ARSampler, "bd3lm": BD3LMSampler, "mdlm": MDLMSampler}


class RequestError(ValueError):
    """A generation request that cannot be served; the message says why."""


def encode_request(tokenizer, request, *, context: int | None = None) -> list[int]:
    """Token ids of one request (BOS first; infill dicts get the full [BOS] p M*m s [EOS] layout)."""
    if isinstance(request, dict):
        if "prompt" in request:
            return encode_request(tokenizer, request["prompt"], context=context)
        missing = [k for k in ("prefix", "suffix", "span") if k not in request]
        if missing:
            raise RequestError(f"infill request needs prefix, suffix and span (missing {missing})")
        span = int(request["span"])
        if span < 1:
            raise RequestError(f"infill span must be >= 1 MASK position, got {span}")
        ids = ([tokenizer.bos] + tokenizer.encode(request["prefix"]) + [tokenizer.mask] * span
               + tokenizer.encode(request["suffix"]) + [tokenizer.eos])
    elif isinstance(request, str):
        ids = [tokenizer.bos] + tokenizer.encode(request)
    else:
        raise RequestError(f"a request is a string or a dict, got {type(request).__name__}")
    if context is not None:
        visible = sum(1 for t in ids if t != tokenizer.mask)
        if len(ids) > context:
            raise RequestError(f"request of {len(ids)} tokens ({visible} visible) is longer than the model's "
                               f"context of {context} tokens; shorten it")
        if tokenizer.mask not in ids and len(ids) == context:
            raise RequestError(f"prompt of {len(ids)} tokens fills the model's context of {context} tokens: no room "
                               f"to generate; shorten it")
    return ids


def build_sampler(method: str, model, tokenizer, config: GenerationConfig):
    if method not in SAMPLERS:
        raise RequestError(f"no sampler for objective {method!r}; choose one of {', '.join(SAMPLERS)}")
    return SAMPLERS[method](model, tokenizer.mask, tokenizer.pad, tokenizer.eos, config, tokenizer=tokenizer)


def check_vocab(model, tokenizer) -> None:
    """The tokenizer must be the checkpoint's (hash recorded by ``load_model``) and fit the embedding."""
    if tokenizer.vocab_size > model.vocab_size:
        raise RequestError(f"tokenizer vocabulary ({tokenizer.vocab_size}) does not match the model's "
                           f"({model.vocab_size}); use the tokenizer.json saved with the checkpoint")
    expected = getattr(model, "tokenizer_hash", None)
    if expected is not None and expected != tokenizer.hash:
        raise RequestError(f"tokenizer vocabulary ({tokenizer.vocab_size}) does not match the model's "
                           f"({model.vocab_size}): hash {tokenizer.hash} differs from the checkpoint's {expected}; "
                           f"use the tokenizer.json saved with the checkpoint")


def generate(model, tokenizer, method: str, requests: list, config: GenerationConfig,
             context: int | None = None, batch_size: int = 8, progress=None) -> list[dict]:
    """Decode ``requests`` in batches; returns one dict per request (text, tokens, nfe, speeds)."""
    check_vocab(model, tokenizer)
    model.eval()
    ids = [encode_request(tokenizer, r, context=context) for r in requests]
    sampler = build_sampler(method, model, tokenizer, config)
    results = []
    for s in range(0, len(ids), batch_size):
        chunk = ids[s:s + batch_size]
        canvas = Canvas.from_prompts(chunk, tokenizer.mask, tokenizer.pad, config.max_new_tokens,
                                     device=next(model.parameters()).device)
        t0 = time.perf_counter()
        out = sampler.generate(canvas)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        for b in range(len(chunk)):
            toks = out.tokens[b]
            text = tokenizer.decode(toks)
            for stop in config.stop_strings:
                if stop in text:
                    text = text[: text.index(stop) + len(stop)]
            results.append({"text": text, "num_tokens": len(toks), "nfe": out.nfe, "steps": out.steps[b],
                            "tokens_per_step": out.tokens_per_step[b], "seconds": dt,
                            "tokens_per_s": len(toks) / dt if dt > 0 else 0.0,
                            "infill": bool(canvas.infill[b]), "sequence": tokenizer.decode(out.sequences[b])})
        if progress is not None:
            progress(len(chunk))
    return results


__all__ = ["generate", "encode_request", "build_sampler", "check_vocab", "RequestError", "SAMPLERS"]
