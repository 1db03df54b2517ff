"""OpenAI-compatible request bodies -> checked generation jobs; one-line 4xx errors for everything else.

A body is a JSON object. Fields (every other name is refused with the list of known ones):

    shared      model, max_tokens (>= 1, <= the server's limit), temperature, top_p, seed, n (1..16),
                stop (a string or a list of up to 16 strings of up to 1000 characters), stream,
                stream_options {include_usage}, user,
                return_token_ids (not OpenAI's: each choice also carries its generated token ids),
                trace (not OpenAI's: the decoding trace, decoding/trace.py: streamed, each step's commits in
                its chunk's ``trace``, the first with the generation ``region``; whole in the response's choice)
    accepted at OpenAI's neutral value only: presence_penalty / frequency_penalty 0, logprobs null / 0,
                echo false, best_of null / n, logit_bias null / {}
    diffusion   every GenerationConfig option its schema exposes to the server (decoding/schema.py; the
                table of docs/guide/decoding.md): window, tau, commit_k, commit_rule, block_size,
                repetition_penalty, length_penalty [start, factor], stop_regex, speculative (method.md 16) ...;
                ``preset`` (gsm8k, cnndm, owt, infill)
    completions prompt: a string, a list of strings, a list of token ids or a list of those; suffix: with a
                string prompt, the completion is infilled between prompt and suffix with max_tokens MASK
                positions ([BOS] prompt [MASK]*max_tokens suffix [EOS], method.md 5.4)
    chat        messages [{role, content}] (system / user / assistant), rendered with the checkpoint's chat
                template and its generation prompt; chat_template_kwargs (e.g. {"enable_thinking": false})
    infill      prefix, suffix, span (the diffusion endpoint; no streaming)

``stop_regex`` runs on RE2 (linear time; :func:`setdiff_mega.decoding.stopping.compile_stop_regex`): a pattern
longer than 1000 characters, compiling to more than 1000 instructions, or using what RE2 lacks (backreferences,
lookaround) is refused with one line, before anything is queued.

Values: defaults = the server's (the checkpoint's decoding defaults, its preset and flags); temperature 0 is
greedy; ``n`` > 1 decodes n jobs with seeds seed, seed + 1, ... A prompt with the MASK token (completions,
chat) is refused: infilling goes through /v1/infill or ``suffix``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from setdiff_mega.decoding import schema
from setdiff_mega.decoding.base import GenerationConfig
from setdiff_mega.decoding.config import OPTIONS
from setdiff_mega.decoding.stopping import compile_stop_regex
from setdiff_mega.errors import DataError, RequestError
from setdiff_mega.inference.api import encode_request
from setdiff_mega.inference.options import layered

SHARED = {"model", "max_tokens", "temperature", "top_p", "seed", "n", "stop", "stream", "stream_options", "user",
          "return_token_ids", "preset", "trace"}
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (None, 0, False),
           "echo": (False,), "logit_bias": (None, {}), "best_of": (None,)}
SERVED = {name: o for name, o in OPTIONS.items() if o.server}       # the request fields of GenerationConfig
DIFFUSION = tuple(name for name in SERVED if name not in SHARED)   # those not OpenAI's
OWN = {"completions": {"prompt", "suffix"}, "chat": {"messages", "chat_template_kwargs", "max_completion_tokens"},
       "infill": {"prefix", "suffix", "span", "prompt"}}
MAX_N = 16
MAX_STOPS, MAX_STOP_CHARS = 16, 1000      # stop strings per request, characters per stop string


@dataclass
class ServerDefaults:
    """What the server applies before a request's own fields."""
    objective: object                 # the checkpoint's objective config (decoding defaults, presets)
    seq_length: int                   # the context L
    base: GenerationConfig            # the server's flags over the checkpoint's defaults
    max_tokens: int = 64              # when a request gives none
    max_tokens_limit: int = 2048      # the largest max_tokens / span accepted
    chat_template_kwargs: dict = field(default_factory=dict)


@dataclass
class Parsed:
    prompts: list                     # token ids per prompt
    config: GenerationConfig
    n: int
    stream: bool
    stops: tuple
    include_usage: bool
    return_token_ids: bool
    trace: bool = False
    samples: tuple = ()               # per sample j < n: ``config`` with seed + j (GenerationConfig.derive: validated)

    def __post_init__(self):
        """Without ``samples`` (a Parsed built by hand), the n samples derived here: never zero jobs."""
        if not self.samples:
            self.samples = tuple(self.config.derive(seed=self.config.seed + j) for j in range(self.n))
        if len(self.samples) != self.n:
            raise ValueError(f"Parsed: {len(self.samples)} sample configs for n = {self.n}")


def _typed(name: str, value):
    """``value`` checked against the option's kind (decoding/schema.py: ints where floats are asked become floats,
    a pair is [start, factor]); one-line RequestError otherwise. Bounds: GenerationConfig.validate."""
    try:
        return schema.from_json(name, SERVED[name], value)
    except ValueError as e:
        raise RequestError(str(e)) from None


def _check_fields(body: dict, endpoint: str) -> None:
    known = SHARED | set(NEUTRAL) | set(DIFFUSION) | OWN[endpoint]
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; this endpoint takes: {', '.join(sorted(known))}")
    for k, ok in NEUTRAL.items():
        if k in body and body[k] not in ok and not (k == "best_of" and body[k] == body.get("n", 1)):
            raise RequestError(f"'{k}' = {body[k]!r} is not supported (only {ok[0]!r}); leave it out")


def _stops(value) -> tuple:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} non-empty strings")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise RequestError(f"a stop string has {longest} characters, more than the limit of {MAX_STOP_CHARS}")
    return tuple(stops)


def config_of(body: dict, d: ServerDefaults, max_tokens_key: str = "max_tokens") -> GenerationConfig:
    """The request's GenerationConfig: server defaults -> preset -> the request's fields (``trace``: recorded),
    validated once, here."""
    base = d.base
    if body.get("preset") is not None:
        if not isinstance(body["preset"], str):
            raise RequestError(f"'preset' must be a string, got {body['preset']!r}"[:200])
        try:
            base = layered(d.objective, d.seq_length, body["preset"], None, base)
        except ValueError as e:
            raise RequestError(str(e)) from None
    over = {name: _typed(name, body[name]) for name, o in SERVED.items()
            if name in body and (body[name] is not None or o.nullable)}      # null: the server's value
    mt = body.get(max_tokens_key, d.max_tokens)
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1 or mt > d.max_tokens_limit:
        raise RequestError(f"'{max_tokens_key}' must be an integer in [1, {d.max_tokens_limit}] (the server's "
                           f"--max-tokens-limit), got {mt!r}"[:200])
    over["max_new_tokens"] = mt
    if "temperature" in over and over["temperature"] < 0:
        raise RequestError(f"'temperature' must be >= 0, got {over['temperature']}")
    if over.get("stop_regex"):                    # RE2 (linear time), checked before anything else compiles it
        try:
            compile_stop_regex(over["stop_regex"])
        except ValueError as e:
            raise RequestError(str(e)) from None
    if body.get("trace") is True:
        over["record"] = True                     # a recorded decode: each token's commit step and confidence
    try:
        return replace(base, **over).validate()
    except ValueError as e:
        raise RequestError(str(e)) from None


def _encode(tok, request, L: int, chat=None) -> list[int]:
    ids = encode_request(tok, request, context=L, chat=chat)
    if tok.mask in ids and not (isinstance(request, dict) and "span" in request):
        raise RequestError(f"the prompt contains the MASK token {tok.token(tok.mask)!r}; infilling goes through "
                           f"POST /v1/infill (prefix, suffix, span) or a completion's 'suffix'")
    return ids


def prompts_of(body: dict, tok, d: ServerDefaults, endpoint: str, chat=None) -> list[list[int]]:
    """Token ids of the request's prompts (checked: type, context length, no MASK)."""
    L = d.seq_length
    if endpoint == "chat":
        msgs = body.get("messages")
        if chat is None:
            raise RequestError("this checkpoint's tokenizer has no chat template (a model imported with one, or "
                               "fine-tuned on conversations, keeps it): use POST /v1/completions")
        try:
            return [_encode(tok, {"messages": msgs}, L, chat)]
        except DataError as e:
            raise RequestError(str(e)) from None
    if endpoint == "infill":
        if "prompt" in body:
            return [encode_request(tok, _str(body, "prompt"), context=L)]
        span = body.get("span")
        if not isinstance(span, int) or isinstance(span, bool) or not 1 <= span <= d.max_tokens_limit:
            raise RequestError(f"'span' must be an integer in [1, {d.max_tokens_limit}], got {span!r}"[:200])
        return [encode_request(tok, {"prefix": _str(body, "prefix"), "suffix": _str(body, "suffix"), "span": span},
                               context=L)]
    prompt = body.get("prompt")
    items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    if len(items) > 64:
        raise RequestError(f"at most 64 prompts per request, got {len(items)}")
    out = []
    for p in items:
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = encode_request(tok, {"input_ids": p}, context=L)
            if tok.mask in ids:
                raise RequestError("the prompt's token ids contain the MASK token; use POST /v1/infill")
        elif isinstance(p, str):
            if body.get("suffix") is not None:
                ids = encode_request(tok, {"prefix": p, "suffix": _str(body, "suffix"),
                                           "span": body.get("max_tokens", d.max_tokens)}, context=L)
            else:
                ids = _encode(tok, p, L)
        else:
            raise RequestError("'prompt' must be a string, a list of strings, a list of token ids or a list of those")
        out.append(ids)
    return out


def _str(body: dict, key: str) -> str:
    v = body.get(key, "")
    if not isinstance(v, str):
        raise RequestError(f"'{key}' must be a string")
    return v


def parse(body, endpoint: str, tok, d: ServerDefaults, chat=None) -> Parsed:
    """A checked request (RequestError with one line otherwise)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_fields(body, endpoint)
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise RequestError(f"'n' must be an integer in [1, {MAX_N}], got {n!r}"[:200])
    stream = body.get("stream", False)
    if not isinstance(stream, bool) or (stream and endpoint == "infill"):
        raise RequestError("'stream' must be true or false (and false for /v1/infill)")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or any(k != "include_usage" for k in opts):
        raise RequestError("'stream_options' takes only include_usage")
    key = "max_completion_tokens" if endpoint == "chat" and "max_completion_tokens" in body else "max_tokens"
    trace = body.get("trace", False)
    if not isinstance(trace, bool):
        raise RequestError(f"'trace' must be true or false, got {trace!r}"[:200])
    config = config_of(body, d, key)
    try:                                          # n samples: seeds seed, seed + 1, ... (each within the bound)
        samples = tuple(config.derive(seed=config.seed + j) for j in range(n))
    except ValueError as e:
        raise RequestError(f"'n' = {n} samples from 'seed' {config.seed}: {e}"[:200]) from None
    prompts = prompts_of(body, tok, d, endpoint, chat)
    return Parsed(prompts, config, n, stream, _stops(body.get("stop")), bool(opts.get("include_usage")),
                  bool(body.get("return_token_ids", False)), trace, samples)


__all__ = ["ServerDefaults", "Parsed", "parse", "config_of", "prompts_of", "DIFFUSION", "SERVED"]
