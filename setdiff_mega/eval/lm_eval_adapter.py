"""lm-evaluation-harness adapter: run the harness's tasks on a setdiff-mega checkpoint.

    from setdiff_mega.eval.lm_eval_adapter import SetDiffLM      # registers model name "setdiff"
    import lm_eval
    lm_eval.simple_evaluate(model=SetDiffLM(checkpoint="runs/tiny_cpu"), tasks=["..."])
    # or: python tools/lm_eval_harness.py --model_args checkpoint=runs/tiny_cpu --tasks ... (harness CLI flags)

Requests (the harness's three kinds), for a context c and continuation y (token ids; the context
starts with BOS and is cut from the left so that c + y fits the model's length L):

* ``loglikelihood(c, y)``: -NLL of y given c from :func:`setdiff_mega.eval.likelihood.sequence_nll`: exact
  for AR, the any-order bound with the context pinned for SetDLM (mean over ``orders`` sampled orders),
  the NELBO for MDLM / BD3LM. ``is_greedy``: every continuation token is the argmax of its prediction (AR:
  teacher forcing; SetDLM: under the first sampled order; MDLM / BD3LM: in the first noise draw, at the
  positions it masked).
* ``loglikelihood_rolling(s)``: the string as ``[BOS] s [EOS]`` chunked to L, summed: the same numbers as
  ``tools/evaluate.py --text`` on that string.
* ``generate_until(c, {until, max_gen_toks})``: the model's own sampler (SetDLM sets, AR tokens, BD3LM
  blocks), cut at the first stop string. Decoding options come from ``model_args`` with the names of
  :class:`~setdiff_mega.inference.GenerationConfig` (``preset=gsm8k``, ``tau=0.9``, ``stop_regex=...``,
  ``repetition_penalty=1.2``, ``length_penalty=80:1.1``, ...; docs/guide/decoding.md); the context
  keeps its last L - 1 tokens and generation may run past L. ``engine=auto`` (the default) decodes with the
  plain-PyTorch twin of an unsharded model (identical tokens, faster); scores always use the native model.

Chat models (lm-eval's ``--apply_chat_template``): ``apply_chat_template(messages)`` renders the harness's chat
history with the checkpoint tokenizer's template and its generation prompt, exactly as supervised training data
and ``tools/generate.py --chat`` render prompts (:class:`~setdiff_mega.data.chat.ChatRenderer`;
``model_args`` ``enable_thinking=true|false`` or ``chat_template_kwargs=<JSON>`` pass the template's keyword
arguments), and requests whose context starts with the rendered text are tokenized as training data is (BOS
first unless the template writes it; the context's ids are used as they are, never re-encoded from a cut
string). ``tokenizer_name`` fingerprints the template and its arguments for the harness's caches.

The harness is an optional extra (``pip install -e .[eval]``); this module imports it lazily.
"""
from __future__ import annotations

import functools
import json

import torch

from setdiff_mega import methods
from setdiff_mega.checkpoint import load_model
from setdiff_mega.data.chat import ChatRenderer, template_hash
from setdiff_mega.inference import generate
from setdiff_mega.inference.engine import decoding_model
from setdiff_mega.inference.options import generation_config

from .likelihood import chunk_documents, pad_batch, sequence_nll


def _base_class():
    try:
        from lm_eval.api.model import LM
    except ImportError as e:           # pragma: no cover - exercised only without the extra
        raise ImportError("the lm-eval adapter needs lm-evaluation-harness: pip install -e '.[eval]'") from e
    return LM


class SetDiffLMCore:
    """Scoring and generation on a loaded checkpoint, independent of the harness's classes."""

    def __init__(self, checkpoint: str, orders: int = 1, seed: int = 0, max_gen_toks: int = 64, batch_size: int = 8,
                 preset: str | None = None, weights: str | None = None, engine: str = "auto",
                 chat_template_kwargs=None, **generation):
        self.model, self.objective, self.tok, self.cfg = load_model(checkpoint, weights=weights)
        thinking = generation.pop("enable_thinking", None)
        kwargs = json.loads(chat_template_kwargs) if isinstance(chat_template_kwargs, str) else \
            dict(chat_template_kwargs or {})
        if thinking is not None:
            kwargs["enable_thinking"] = str(thinking).lower() in ("1", "true", "yes")
        self.chat_kwargs, self._chat = kwargs, None
        self.decoder = decoding_model(self.model, self.cfg, self.tok, engine)     # generation; scores: native
        self.L = self.cfg.data.seq_length
        self.orders, self.seed = int(orders), int(seed)
        self.max_gen_toks, self.batch_size = int(max_gen_toks), int(batch_size)
        self.generation = generation_config(self.cfg.objective, self.L, preset, {"seed": seed, **generation})

    def _score(self, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        keep = max(1, self.L - len(cont))
        if len(cont) >= self.L:
            raise ValueError(f"continuation of {len(cont)} tokens does not fit the model's length {self.L}")
        ctx = ctx[-keep:]
        seq = ctx + cont
        n = len(seq)
        T = n if methods.get(self.objective.name).causal else self.L
        tokens, padding = pad_batch([seq], T, self.tok.pad)
        context = torch.zeros_like(padding)
        context[0, :len(ctx)] = True
        r = sequence_nll(self.model, self.objective, tokens, context=context, padding=padding,
                         samples=self.orders, seed=self.seed, greedy=True)
        return -float(r["nll"][0]), bool(r["greedy"][0])

    @property
    def chat(self) -> ChatRenderer:
        """The checkpoint's chat renderer (built on first use; a one-line error without a template)."""
        if self._chat is None:
            self._chat = ChatRenderer.of(self.tok, self.chat_kwargs)
        return self._chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The harness's chat history as the training data renders it (with the generation prompt)."""
        if not add_generation_prompt:
            raise ValueError("the setdiff adapter renders chat prompts with the generation prompt only (an "
                             "assistant prefill is not supported)")
        return self.chat.render_prompt(messages)

    @property
    def tokenizer_name(self) -> str:
        return f"setdiff-{self.tok.hash}-{template_hash(self.tok.chat_template, self.chat_kwargs)}"

    def context_ids(self, text: str) -> list[int]:
        """A request's context as token ids: BOS first (unless the text, e.g. a chat template's, starts with it)."""
        ids = self.tok.encode(text)
        return ids if ids[:1] == [self.tok.bos] else [self.tok.bos, *ids]

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        out = []
        for c, y in pairs:                    # the same noise for every request: scores are comparable
            out.append(self._score(self.context_ids(c), self.tok.encode(y)))
        return out

    def loglikelihood_rolling(self, texts: list[str]) -> list[float]:
        out = []
        for s in texts:
            chunks, ids = chunk_documents([self.tok.encode(s)], self.L, self.tok.bos, self.tok.eos)
            tokens, padding = pad_batch(chunks, self.L, self.tok.pad)
            r = sequence_nll(self.model, self.objective, tokens, padding=padding, samples=self.orders,
                             seed=self.seed, row_ids=ids)
            out.append(-float(r["nll"].sum()))
        return out

    def generate_until(self, requests: list[tuple[str, dict]]) -> list[str]:
        out = []
        for ctx, kw in requests:
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            gc = self.generation.derive(max_new_tokens=int(kw.get("max_gen_toks", self.max_gen_toks)),
                                        stop_strings=tuple(self.generation.stop_strings) + tuple(until))
            ids = self.context_ids(ctx)
            if len(ids) > self.L:                     # keep the end of a long context (BOS + L - 1 tokens)
                ids = [self.tok.bos, *ids[-(self.L - 1):]]
            text = generate(self.decoder, self.tok, self.objective, [{"input_ids": ids}], gc, context=self.L,
                            batch_size=1)[0]["text"]
            for s in until:
                if s and s in text:
                    text = text[:text.index(s)]
            out.append(text)
        return out


@functools.cache
def make_lm_class():
    """The harness model class, registered as ``setdiff`` once per process (created on first use so that
    importing this module needs no harness)."""
    LM = _base_class()
    from lm_eval.api.registry import register_model  # gated: the optional [eval] extra

    class SetDiffLM(LM):
        """lm-eval model ``setdiff``: model_args ``checkpoint=...,orders=1,seed=0,max_gen_toks=64`` plus any
        decoding option (``preset=gsm8k,tau=0.9,window=4,...``), ``weights=ema|raw`` and
        ``engine=auto|plain|native`` (:mod:`setdiff_mega.inference.engine`)."""

        def __init__(self, checkpoint: str, orders: int = 1, seed: int = 0, max_gen_toks: int = 64,
                     batch_size: int = 8, preset=None, weights=None, max_batch_size=None, device=None, dtype=None,
                     engine: str = "auto", chat_template_kwargs=None, **generation):
            super().__init__()
            self.core = SetDiffLMCore(checkpoint, int(orders), int(seed), int(max_gen_toks), int(batch_size),
                                      preset, weights, str(engine), chat_template_kwargs,
                                      **{k: str(v) for k, v in generation.items()})

        def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
            return self.core.apply_chat_template(chat_history, add_generation_prompt)

        @property
        def tokenizer_name(self) -> str:
            return self.core.tokenizer_name

        def chat_template(self, chat_template=False):
            return self.core.tok.chat_template or "" if chat_template else None

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self.core.loglikelihood([r.args for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self.core.loglikelihood_rolling([r.args[0] for r in requests])

        def generate_until(self, requests, disable_tqdm: bool = False):
            return self.core.generate_until([r.args for r in requests])

    return register_model("setdiff")(SetDiffLM)


def __getattr__(name):
    if name == "SetDiffLM":
        return make_lm_class()
    raise AttributeError(name)


__all__ = ["SetDiffLM", "SetDiffLMCore", "make_lm_class"]  # noqa: F822  (SetDiffLM: module __getattr__)
