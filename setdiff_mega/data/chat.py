"""Supervised records -> (tokens, target mask): conversations rendered with the tokenizer's chat template.

Records are ``{"prompt": str, "response": str}`` (optionally ``"system"``) or OpenAI-style
``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``. A prompt / response
record is the conversation [system?, user, assistant].

Rendering (transformers' ``apply_chat_template`` on the adopted tokenizer, with ``template_kwargs`` such as
Qwen3's ``enable_thinking``) follows the reference's rule, "the target is the string difference from the
full conversation": for an assistant turn i,

    prompt_i = render(messages[:i], add_generation_prompt=True)
    full_i   = render(messages[:i + 1])                    target_i = full_i[len(prompt_i):]

so the text is the segments [ctx_1, target_1, ctx_2, target_2, ...] with ctx_k = prompt_k minus the text
already laid out (the previous full_{k-1}); each segment is tokenized on its own (no special tokens added), so
the loss mask falls exactly on the response's tokens. ``loss_on="all"`` trains on every assistant turn (the
other tokens are context: visible, pinned first in a diffusion order, never in the loss), ``"last"`` on the
last one (everything before it is context; turns after it are dropped). BOS is prepended as context unless
the rendered text starts with it; EOS is appended as a target token (the model learns to stop).

Without a chat template (``template=None``) a prompt / response record is the plain ``prompt`` + ``response``
(the reference's plain GSM8K layout); conversations need a template. Errors name the record
(``file:line``) and the fix: no assistant turn, an empty response, an unknown role, a template without a
generation prompt, or whose generation prompt is not a prefix of the rendered conversation.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from .indexed import DataError

ROLES = ("system", "user", "assistant")


def template_hash(template: str | None, kwargs: dict) -> str | None:
    """sha256 (16 hex) of the template text and its keyword arguments (recorded in the manifest)."""
    if template is None:
        return None
    return hashlib.sha256((template + json.dumps(kwargs, sort_keys=True)).encode()).hexdigest()[:16]


def conversation(record, where) -> list[dict]:
    """The messages of a record (see the module docstring), checked."""
    if not isinstance(record, dict):
        raise DataError(f"{where()}: expected a JSON object with 'messages' or 'prompt' and 'response'")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where()}: 'messages' must be a non-empty list of {{role, content}} objects")
    elif "prompt" in record and "response" in record:
        msgs = ([{"role": "system", "content": record["system"]}] if record.get("system") else []) + [
            {"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    else:
        keys = ", ".join(map(str, record)) or "none"
        raise DataError(f"{where()}: a supervised record has 'messages', or 'prompt' and 'response' (keys: {keys})")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where()}: message {i} needs a string 'content' (got {str(m)[:60]})")
        if m.get("role") not in ROLES:
            raise DataError(f"{where()}: message {i} has the unknown role {m.get('role')!r}; roles are "
                            f"{', '.join(ROLES)}: rename it or drop the record")
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where()}: the conversation has no assistant turn, so nothing to train on: drop the record")
    empty = [i for i in turns if not msgs[i]["content"].strip()]
    if empty:
        raise DataError(f"{where()}: assistant message {empty[0]} is empty: fill in the response or drop the record")
    return msgs


class ChatRenderer:
    """Render and tokenize supervised records (module docstring). ``tokenizer``: the project's Tokenizer."""

    def __init__(self, tokenizer, template: str | None = None, template_kwargs: dict | None = None,
                 loss_on: str = "all", prepend_bos: bool = True, append_eos: bool = True):
        if loss_on not in ("all", "last"):
            raise DataError(f"loss_on={loss_on!r} is not one of all, last")
        self.tok, self.template, self.kwargs = tokenizer, template, dict(template_kwargs or {})
        self.loss_on, self.prepend_bos, self.append_eos = loss_on, prepend_bos, append_eos
        self._hf = None
        if template is not None:
            from transformers import PreTrainedTokenizerFast  # noqa: PLC0415  (the template engine, SFT only)

            t = tokenizer
            self._hf = PreTrainedTokenizerFast(tokenizer_object=t.hf, chat_template=template,
                                               bos_token=t.token(t.bos), eos_token=t.token(t.eos),
                                               pad_token=t.token(t.pad))

    @classmethod
    def of(cls, tokenizer, template_kwargs="{}") -> "ChatRenderer":
        """Generation prompts of a checkpoint: its tokenizer's chat template with ``template_kwargs`` (a dict or
        its JSON text, e.g. Qwen3's ``{"enable_thinking": false}``); one-line errors when either is unusable."""
        kwargs = template_kwargs
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError as e:
                raise DataError(f"chat template kwargs {template_kwargs!r} are not JSON ({e.msg})") from None
        if not isinstance(kwargs, dict):
            raise DataError(f"chat template kwargs must be a JSON object, got {template_kwargs!r}")
        if tokenizer.chat_template is None:
            raise DataError("the checkpoint's tokenizer has no chat template (a model imported with one, or "
                            "fine-tuned on conversations, keeps it): send plain prompts")
        return cls(tokenizer, tokenizer.chat_template, kwargs)

    def _render(self, msgs, generation: bool, where) -> str:
        try:
            return self._hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation,
                                                **self.kwargs)
        except Exception as e:                 # jinja2 errors: the template's own message
            raise DataError(f"{where()}: the chat template failed on this record ({type(e).__name__}: {e})") from None

    def segments(self, msgs, where) -> list[tuple[str, bool]]:
        """[(text, is_target)] of a checked conversation."""
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if self.template is None:
            if [m["role"] for m in msgs if m["role"] != "system"] != ["user", "assistant"]:
                raise DataError(f"{where()}: a conversation needs a chat template (the tokenizer has none): pass "
                                f"--chat-template FILE, or give prompt / response records")
            return [("".join(m["content"] for m in msgs[:-1]), False), (msgs[-1]["content"], True)]
        out, laid = [], ""
        for i in (turns if self.loss_on == "all" else turns[-1:]):
            prompt, full = self._render(msgs[:i], True, where), self._render(msgs[:i + 1], False, where)
            if prompt == self._render(msgs[:i], False, where):
                raise DataError(f"{where()}: the chat template renders no generation prompt (add_generation_prompt "
                                f"changes nothing), so the response cannot be told from the markup: use a template "
                                f"with a generation prompt (--chat-template FILE)")
            if not prompt.startswith(laid) or not full.startswith(prompt) or len(full) == len(prompt):
                raise DataError(f"{where()}: the chat template's rendering of assistant turn {i} does not extend "
                                f"the conversation before it (its generation prompt is not a prefix of the "
                                f"rendered turn): use a template with add_generation_prompt, or --loss-on last")
            out += [(prompt[len(laid):], False), (full[len(prompt):], True)]
            laid = full
        return out

    def prompt_ids(self, request) -> list[int]:
        """A generation request rendered like training data: a string is one user turn, ``{"messages": [...]}``
        or a list of messages the conversation so far; the template's generation prompt follows (BOS first
        unless the template writes it)."""
        return self.context_ids(self.render_prompt(request))

    def render_prompt(self, request) -> str:
        """The text of a generation request (:meth:`prompt_ids`' rendering, before tokenization)."""
        if self.template is None:
            raise DataError("chat prompts need a chat template: the checkpoint's tokenizer has none (pass one, "
                            "or send plain prompts)")
        msgs = request.get("messages") if isinstance(request, dict) else request
        msgs = [{"role": "user", "content": msgs}] if isinstance(msgs, str) else msgs
        if not isinstance(msgs, list) or not msgs or any(
                not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str)
                for m in msgs):
            raise DataError(f"a chat request is a string or a list of {{role, content}} messages with roles "
                            f"{', '.join(ROLES)}")
        return self._render(msgs, True, lambda: "chat request")

    def context_ids(self, text: str) -> list[int]:
        """Token ids of rendered text as training data lays it out: BOS first unless the template wrote it."""
        ids = self.tok.encode(text)
        return ids if ids[:1] == [self.tok.bos] or not self.prepend_bos else [self.tok.bos] + ids

    def encode(self, record, where) -> tuple[np.ndarray, np.ndarray]:
        """(token ids [n] int64, target mask [n] uint8) of one record."""
        segs = self.segments(conversation(record, where), where)
        ids = self.tok.encode_batch([s for s, _ in segs])
        toks = [t for part in ids for t in part]
        mask = [int(tgt) for part, (_, tgt) in zip(ids, segs) for _ in part]
        if self.prepend_bos and (not toks or toks[0] != self.tok.bos):
            toks, mask = [self.tok.bos] + toks, [0] + mask
        if self.append_eos:
            toks, mask = toks + [self.tok.eos], mask + [1]
        if not any(mask[:-1] if self.append_eos else mask):
            raise DataError(f"{where()}: the response renders to no tokens: fill in the response or drop the record")
        return np.asarray(toks, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


__all__ = ["ChatRenderer", "conversation", "template_hash", "ROLES"]
