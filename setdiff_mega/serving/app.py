"""The HTTP side: an ASGI (Starlette) application speaking the OpenAI API over the engine process's scheduler.

    GET  /                       the playground (playground.html: a prompt, the options, the canvas filling in
                                 as the trace streams; static, no build step, no request but to this server)
    GET  /health                 {"status": "ok", "running", "queued", "loop", "loop_alive", "last_beat_age_s",
                                 "last_step_age_s", "engine_restarts"}; 503 with "reason" when the engine is
                                 gone, restarting, or its decode loop dead or stalled (from shared memory:
                                 answered at once whatever the engine does, :mod:`.pulse`)
    GET  /v1/models              the served model (id, max_model_len = the context L)
    GET  /metrics                Prometheus text format (:mod:`.metrics`)
    POST /v1/completions         OpenAI completions (``suffix``: infilling between prompt and suffix)
    POST /v1/chat/completions    OpenAI chat completions (the checkpoint's chat template)
    POST /v1/infill              the diffusion endpoint: {prefix, suffix, span} -> the span's text

This process parses and answers; the model and the decode loop are in the engine process (:mod:`.engine_process`,
reached through :class:`~.client.EngineClient`). A request is parsed and checked (:mod:`.protocol`; 400 with one
line), queued as ``n`` jobs per prompt (429 when the queue is full, 503 when the engine is gone) and answered when
its jobs are done, or streamed as server-sent events (``data: {chunk}`` per text delta (the deltas waiting when the
stream writes merged per choice, :mod:`.outbox`), with ``"trace": true`` a chunk per decode step whose choice holds
the step's commits (``trace``), the finish reason, the usage with ``stream_options.include_usage``, then ``data:
[DONE]``). A client that disconnects cancels its jobs (non-streaming requests poll for it every 0.1 s); a job past
the server's timeout ends with 504 (or an error event). Errors have OpenAI's shape: {"error": {"message", "type",
"code"}}.

Hostile clients (docs/guide/serving.md): every request has an HTTP-side deadline (the server's timeout plus
:data:`DEADLINE_SLACK`: 504 even when the engine never answers); a request of more jobs than one client may have in
flight is refused at once (400, with the limit); a client is its API key when the server has several, else its
address (:func:`~.bounded.client_id`: fair admission); the chat renderers are cached per ``chat_template_kwargs``
in an LRU of ``chat_cache_size`` entries.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.errors import DataError, RequestError

from .bounded import LRU, client_id
from .messages import EngineGone, JobSpec, NeverFits, QueueFull
from .outbox import coalesce
from .protocol import parse

DISCONNECT_POLL = 0.1      # seconds between checks that a non-streaming client is still there
DEADLINE_SLACK = 10.0      # seconds past the server's timeout after which the HTTP side answers 504 by itself
PLAYGROUND = Path(__file__).with_name("playground.html")
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/infill": "infill"}


def one_line(message: str, limit: int = 300) -> str:
    """A message as one line of at most ``limit`` characters (values echoed from a body may be anything)."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error(status: int, message: str, kind: str | None = None) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    message = one_line(message)
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


class NonFinite(ValueError):
    """NaN / Infinity in a request body (json's ``parse_constant`` hook)."""


def _refuse(constant: str):
    raise NonFinite(constant)


class BearerAuth:
    """``--api-key``: every /v1 request needs ``Authorization: Bearer <key>`` (401 otherwise, as vLLM's);
    /health and /metrics stay open for probes."""

    def __init__(self, app, keys: tuple):
        self.app, self.keys = app, tuple(b"Bearer " + k for k in keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not sum(hmac.compare_digest(given, k) for k in self.keys):    # every key compared: constant time
                await error(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                            "authentication_error")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Server:
    def __init__(self, engine, tokenizer, defaults, model_name: str, metrics, timeout: float | None = None,
                 max_body: int = 4 << 20, api_key: str | None = None, chat_cache_size: int = 16):
        """``engine``: the started :class:`~.client.EngineClient`; ``metrics``: this process's
        :class:`~.metrics.HttpMetrics`; ``api_key``: one key, or several separated by commas (each a client of
        its own for fair admission)."""
        self.engine, self.tok, self.defaults = engine, tokenizer, defaults
        self.api_key = api_key
        self.keys = tuple(k.strip().encode() for k in (api_key or "").split(",") if k.strip())
        self.model_name, self.metrics, self.timeout, self.max_body = model_name, metrics, timeout, max_body
        self.created = int(time.time())
        self._chats = LRU(chat_cache_size)          # chat_template_kwargs (client input) -> its renderer
        if hasattr(metrics, "watch"):
            metrics.watch(engine)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.engine.attach(asyncio.get_running_loop())      # the engine's events are read on this loop
        yield

    def app(self) -> Starlette:
        routes = [Route("/", self.playground), Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/metrics", self.prometheus)]
        routes += [Route(path, self.generate, methods=["POST"]) for path in ENDPOINTS]
        app = Starlette(routes=routes, lifespan=self._lifespan)
        if self.keys:
            app.add_middleware(BearerAuth, keys=self.keys)
        return app

    async def playground(self, request: Request) -> Response:
        """The playground page (static: it loads nothing but what it asks /v1/completions for)."""
        return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))

    async def health(self, request: Request) -> Response:
        state = self.engine.health()
        return JSONResponse(state, 200 if state["status"] == "ok" else 503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "setdiff-mega",
            "max_model_len": self.defaults.seq_length}]})

    async def prometheus(self, request: Request) -> Response:
        try:
            engine = await self.engine.ask("metrics", timeout=2.0)
        except (EngineGone, asyncio.TimeoutError):
            engine = b""                                    # the HTTP side's own counters still answer
        return Response(self.metrics.render() + engine, media_type=self.metrics.content_type)

    def _chat(self, body: dict):
        kwargs = body.get("chat_template_kwargs", self.defaults.chat_template_kwargs)
        key = json.dumps(kwargs, sort_keys=True) if isinstance(kwargs, dict) else None
        if key is None:
            raise RequestError("'chat_template_kwargs' must be a JSON object")
        if self.tok.chat_template is None:
            return None
        try:
            return self._chats.get(key, lambda: ChatRenderer.of(self.tok, kwargs))
        except DataError as e:
            raise RequestError(str(e)) from None

    async def _body(self, request: Request, endpoint: str):
        raw = await request.body()
        if len(raw) > self.max_body:
            return None, error(413, f"the request body has {len(raw)} bytes, more than the limit of {self.max_body}")
        try:
            body = json.loads(raw, parse_constant=_refuse)
        except NonFinite:
            return None, error(400, "the request body holds NaN or Infinity; send finite numbers")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return None, error(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)})")
        if isinstance(body, dict) and body.get("model") not in (None, self.model_name):
            return None, error(404, f"model {body.get('model')!r} is not served here; this server serves "
                                    f"{self.model_name!r} (GET /v1/models)", "model_not_found")
        try:
            chat = self._chat(body) if endpoint == "chat" and isinstance(body, dict) else None
            return parse(body, endpoint, self.tok, self.defaults, chat), None
        except RequestError as e:
            return None, error(400, str(e))

    async def generate(self, request: Request) -> Response:
        try:
            return await self._generate(request)
        except Exception as e:                # noqa: BLE001 (a bug answers one JSON line, never a plain-text 500)
            return error(500, f"internal error: {type(e).__name__}: {e}")

    async def _generate(self, request: Request) -> Response:
        endpoint = ENDPOINTS[request.url.path]
        parsed, err = await self._body(request, endpoint)
        if err is not None:
            self.metrics.request(endpoint, err.status_code)
            return err
        queue, now = asyncio.Queue(), time.monotonic()
        specs = [JobSpec(-1, ids, cfg, parsed.stops, self.timeout, parsed.trace, now)
                 for ids in parsed.prompts for cfg in parsed.samples]
        try:
            jobs = self.engine.submit(specs, queue, client_id(request.scope, self.keys))
        except NeverFits as e:
            self.metrics.request(endpoint, 400)
            shape = f"{len(parsed.prompts)} prompts x n={parsed.n}" if len(specs) > 1 else "1 job"
            return error(400, f"this request has {e.jobs} jobs ({shape}); one client may have at most {e.limit} "
                              f"in flight (the server holds {e.capacity}: --max-batch + --max-queue): it can never "
                              f"be admitted; split it into requests of at most {e.limit} jobs")
        except QueueFull as e:
            self.metrics.request(endpoint, 429)
            return error(429, str(e), "rate_limit_error")
        except EngineGone as e:
            self.metrics.request(endpoint, 503)
            return error(503, str(e))
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if parsed.stream:
            self.metrics.request(endpoint, 200)
            return StreamingResponse(self._stream(jobs, queue, parsed, endpoint, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        response = await self._collect(request, jobs, queue, parsed, endpoint, rid)
        self.metrics.request(endpoint, response.status_code)
        return response

    def _cancel(self, jobs) -> None:
        for job in jobs:
            self.engine.cancel(job)

    def _deadline(self) -> float | None:
        """When the HTTP side stops waiting for a request's jobs (the engine's own timeout, then some slack)."""
        return None if self.timeout is None else time.monotonic() + self.timeout + DEADLINE_SLACK

    def _late(self, deadline: float | None) -> bool:
        return deadline is not None and time.monotonic() > deadline

    async def _collect(self, request, jobs, queue, parsed, endpoint, rid) -> Response:
        infos: dict = {}
        checked, deadline = time.monotonic(), self._deadline()
        try:
            while len(infos) < len(jobs):
                try:
                    i, event, payload = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    i = event = payload = None
                    if self._late(deadline):
                        self._cancel(jobs)
                        return error(504, f"no answer from the decoding engine within {self.timeout:g} s (the "
                                          f"server's --request-timeout) and {DEADLINE_SLACK:g} s more")
                if time.monotonic() - checked >= DISCONNECT_POLL:      # whatever the decode emits meanwhile
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        self._cancel(jobs)
                        return Response(status_code=499)
                if event is None:
                    continue
                if event == "error":
                    self._cancel(jobs)
                    return error(*payload)
                if event == "done":
                    if payload["finish_reason"] == "timeout":
                        self._cancel(jobs)
                        return error(504, f"the request timed out after {self.timeout:g} s")
                    infos[i] = payload
        except asyncio.CancelledError:
            self._cancel(jobs)
            raise
        return JSONResponse(self._body_of([infos[i] for i in range(len(jobs))], parsed, endpoint, rid))

    def _choice(self, i: int, info: dict, parsed, endpoint: str) -> dict:
        if endpoint == "chat":
            c = {"index": i, "message": {"role": "assistant", "content": info["text"]},
                 "finish_reason": info["finish_reason"], "logprobs": None}
        else:
            c = {"index": i, "text": info["text"], "finish_reason": info["finish_reason"], "logprobs": None}
        if parsed.return_token_ids or endpoint == "infill":
            c["token_ids"] = info["token_ids"]
        if "trace" in info:
            c["trace"] = info["trace"]
        return c

    def _usage(self, infos, parsed) -> dict:
        prompt = sum(len(p) for p in parsed.prompts)
        done = sum(i["completion_tokens"] for i in infos)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _body_of(self, infos, parsed, endpoint, rid) -> dict:
        obj = {"chat": "chat.completion", "completions": "text_completion", "infill": "infill"}[endpoint]
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                "choices": [self._choice(i, info, parsed, endpoint) for i, info in enumerate(infos)],
                "usage": self._usage(infos, parsed)}

    def _chunk(self, rid, endpoint, i, text=None, finish=None, first=False, token_ids=None, trace=None) -> str:
        if endpoint == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if trace is not None:
            choice["trace"] = trace
        return "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                      "model": self.model_name, "choices": [choice]}) + "\n\n"

    def _chunks(self, events, infos: dict, parsed, endpoint: str, rid) -> tuple[list, bool]:
        """The SSE chunks of ``events`` (finished choices' summaries go to ``infos``), and whether an error ended
        the stream."""
        out = []
        for i, event, payload in events:
            if event == "delta":
                out.append(self._chunk(rid, endpoint, i, text=payload))
            elif event == "trace":
                out.append(self._chunk(rid, endpoint, i, trace=payload))
            elif event == "error" or payload["finish_reason"] == "timeout":
                status, message = payload if event == "error" else (504, "the request timed out")
                out.append("data: " + json.dumps({"error": {"message": one_line(message), "type": "server_error"
                                                            if status >= 500 else "invalid_request_error",
                                                            "code": status}}) + "\n\n")
                return out, True
            else:
                infos[i] = payload
                ids = payload["token_ids"] if parsed.return_token_ids else None
                out.append(self._chunk(rid, endpoint, i, finish=payload["finish_reason"], token_ids=ids))
        return out, False

    async def _stream(self, jobs, queue, parsed, endpoint, rid):
        infos: dict = {}
        try:
            if endpoint == "chat":
                for i in range(len(jobs)):
                    yield self._chunk(rid, endpoint, i, first=True)
            failed, deadline = False, self._deadline()
            while len(infos) < len(jobs) and not failed:
                try:
                    events = [await asyncio.wait_for(queue.get(), timeout=None if deadline is None else
                                                     max(0.0, deadline - time.monotonic()))]
                except asyncio.TimeoutError:
                    events = [(0, "error", (504, f"no answer from the decoding engine within {self.timeout:g} s "
                                                 f"and {DEADLINE_SLACK:g} s more"))]
                while not queue.empty():              # what else is waiting goes out in the same write
                    events.append(queue.get_nowait())
                chunks, failed = self._chunks(coalesce(events), infos, parsed, endpoint, rid)
                yield "".join(chunks)
            if parsed.include_usage and len(infos) == len(jobs):
                usage = self._usage(list(infos.values()), parsed)
                yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk" if endpoint == "chat"
                                             else "text_completion", "created": int(time.time()),
                                             "model": self.model_name, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:                                   # a client gone mid-stream: its jobs leave the batch
            self._cancel(jobs)


__all__ = ["Server", "ENDPOINTS", "error"]
