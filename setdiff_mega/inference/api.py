"""High-level generation: text requests -> batched canvas -> the objective's sampler -> text + stats.

Requests are strings or dicts:

* ``"Question: ..."``                 plain prompt, continued for ``max_new_tokens`` tokens;
* ``"A <|mask|><|mask|> B"``           infill: each ``<|mask|>`` is one position to fill;
* ``{"prefix": ..., "suffix": ..., "span": m}``  infill of m tokens between prefix and suffix,
  laid out as ``[BOS] prefix [MASK]*m suffix [EOS]`` (method.md 5.4);
* with a chat renderer (``chat=``, a fine-tuned model): a string is a user turn and ``{"messages": [...]}``
  a conversation, rendered with the chat template and its generation prompt, as the training data was;
* ``{"input_ids": [...]}``             token ids, used as given (BOS first: the caller's business).

Every request starts with BOS (as every training document does). The sampler follows the model's
training objective: setdlm -> :class:`SetDLMSampler`, ar -> :class:`ARSampler`, bd3lm ->
:class:`BD3LMSampler`, mdlm -> :class:`MDLMSampler`. Results carry the text, token counts, forward
passes (NFE), tokens per step and tokens/s (wall time includes the prefill).

Context: a request's visible tokens must fit the model's length L; generation may run past L (the
samplers keep the newest L tokens in view, positions keep growing: :mod:`.context`).
"""
from __future__ import annotations

import time
from dataclasses import asdict

import torch

from setdiff_mega import methods
from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.decoding.trace import traces
from setdiff_mega.errors import DataError, RequestError


def encode_request(tokenizer, request, *, context: int | None = None, chat=None) -> list[int]:
    """Token ids of one request (BOS first; infill dicts get the full [BOS] p M*m s [EOS] layout). ``chat``
    (a :class:`~setdiff_mega.data.chat.ChatRenderer`): a string or ``{"messages": [...]}`` request is rendered
    with the chat template and its generation prompt, as supervised training data is."""
    if chat is not None and (isinstance(request, str) or (isinstance(request, dict) and "messages" in request)):
        try:
            ids = chat.prompt_ids(request)
        except DataError as e:
            raise RequestError(str(e)) from None
        return _fits(ids, tokenizer, context)
    if isinstance(request, dict):
        if "input_ids" in request:
            ids = request["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < tokenizer.vocab_size
                                                                   for t in ids):
                raise RequestError(f"input_ids must be a non-empty list of token ids in [0, {tokenizer.vocab_size})")
            return _fits(list(ids), tokenizer, context)
        if "prompt" in request:
            return encode_request(tokenizer, request["prompt"], context=context, chat=chat)
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
    return _fits(ids, tokenizer, context)


def _fits(ids: list[int], tokenizer, context: int | None) -> list[int]:
    if context is not None:
        visible = sum(1 for t in ids if t != tokenizer.mask)
        if visible > context:
            raise RequestError(f"request with {visible} visible tokens is longer than the model's context of "
                               f"{context} tokens; shorten it")
    return ids


def build_sampler(method, model, tokenizer, config: GenerationConfig):
    """``method``: an objective name, or the checkpoint's objective (whose order prior FHT writes use)."""
    name = getattr(method, "name", method)
    try:
        cls = methods.get(name).sampler_class()
    except methods.MethodError:
        raise RequestError(f"no sampler for objective {name!r}; choose one of {', '.join(methods.names())}") \
            from None
    prior = method if hasattr(method, "decode_order_times") else None     # an objective with an order prior
    return cls(model, tokenizer.mask, tokenizer.pad, tokenizer.eos, config, tokenizer=tokenizer,
                          order_prior=prior)


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


def generate(model, tokenizer, method, requests: list, config: GenerationConfig,
             context: int | None = None, batch_size: int = 8, progress=None, chat=None) -> list[dict]:
    """Decode ``requests`` in batches; returns one dict per request (text, tokens, nfe, speeds).

    ``method``: the objective (or its name); ``context``: the model's length L (the default
    ``config.context_length``); ``chat``: render prompts with the chat template (:func:`encode_request`)."""
    check_vocab(model, tokenizer)
    model.eval()
    if config.context_length is None and context is not None:
        config = config.derive(context_length=int(context))   # validated once: the changed field checked
    ids = [encode_request(tokenizer, r, context=context, chat=chat) for r in requests]
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
                            "committed": out.committed[b], "tokens_per_step": out.tokens_per_step[b], "seconds": dt,
                            "tokens_per_s": len(toks) / dt if dt > 0 else 0.0,
                            "infill": bool(canvas.infill[b]), "sequence": tokenizer.decode(out.sequences[b])})
            if out.commit_steps:             # record=True: each generated token's commit call and confidence
                results[-1].update(tokens=toks, commit_steps=out.commit_steps[b], confidences=out.confidences[b],
                                   trace=row_trace(method, canvas, out, config, b, tokenizer))
        if progress is not None:
            progress(len(chunk))
    return results


def row_trace(method, canvas, out, config, b: int, tokenizer) -> dict:
    """Row ``b``'s decoding trace (:mod:`setdiff_mega.decoding.trace`) as a dict, each token's text filled in."""
    trace = traces(getattr(method, "name", method), canvas, out, config)[b]
    trace.texts = [tokenizer.decode([t]) for t in trace.tokens]
    return asdict(trace)


__all__ = ["generate", "encode_request", "build_sampler", "check_vocab", "RequestError", "row_trace"]
