"""The server's entry point (``tools/serve.py``, ``setdiff-serve``): a checkpoint behind an OpenAI-compatible
HTTP API on uvicorn, decoded with step-level continuous batching (:mod:`setdiff_mega.serving`).

    python tools/serve.py --checkpoint runs/tiny_cpu --port 8000 --max-batch 8
    curl localhost:8000/v1/completions -d '{"prompt": "Once upon a time", "max_tokens": 32}'

Request defaults: the checkpoint's decoding defaults (``--preset`` and the decoding flags of
``tools/generate.py`` on top); every request may override them (:mod:`setdiff_mega.serving.protocol`).

Two processes: this one (uvicorn: parsing, the OpenAI responses, SSE) and the engine it spawns
(:mod:`setdiff_mega.serving.engine_process`: the model and the scheduler loop), joined by a pipe, so the HTTP side's
Python never holds the GIL the decode loop needs. ``--threads`` are the engine's.

Exposure: the server listens on ``--host`` (loopback by default) and nowhere else (the engine's single-rank process
group rendezvous in-process; the two processes talk over a socket pair, which listens nowhere); ``--api-key`` (or
``SETDIFF_API_KEY``) requires ``Authorization: Bearer <key>`` on /v1. SIGTERM or SIGINT drain: the listener closes,
requests in flight finish for up to ``--shutdown-grace`` seconds, the engine stops and the process exits with status
0.

Supervision (docs/guide/serving.md): a watchdog restarts the engine when its process dies, its decode loop dies, or
the loop does not turn for ``--stall-timeout`` seconds (the requests in flight fail with one line, 503), up to
``--engine-restarts`` times within ``--engine-restart-window`` seconds; beyond that the server drains and exits
with status 3 (EXIT_ENGINE_FAILED), for systemd's ``Restart=on-failure`` or Kubernetes to start it again.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from setdiff_mega.cli import run_cli

EXIT_ENGINE_FAILED = 3          # the engine failed and could not be restarted (--engine-restarts used up)


def parse_args(argv=None):
    from setdiff_mega.inference.options import add_chat_arguments, add_generation_arguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="run directory, checkpoints/ directory, step directory or Hugging Face export")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--served-model-name", default=None, help="the model id of /v1/models (default: the "
                   "checkpoint directory's name)")
    p.add_argument("--max-batch", type=int, default=8, help="jobs decoded together (one KV cache each)")
    p.add_argument("--max-queue", type=int, default=256, help="jobs waiting beyond the batch; more: HTTP 429")
    p.add_argument("--max-client-jobs", type=int, default=None, help="jobs one client (an API key when several are "
                   "given, else an address) may have in flight, queued or decoding; more: HTTP 429, and a request of "
                   "more jobs than this alone: HTTP 400 (default: half of --max-batch + --max-queue, at least "
                   "--max-batch); waiting jobs are taken round-robin by client")
    p.add_argument("--client-row-share", type=int, default=None, help="batch rows one client may hold while "
                   "another client has work (a client alone always gets all --max-batch rows; its jobs beyond the "
                   "share wait in the queue, not refused); default: 2 on a CPU (where a step's cost grows with its "
                   "rows), on a GPU --max-batch divided by the clients with work, rounded up; --max-batch: no share "
                   "(docs/guide/serving.md)")
    p.add_argument("--stall-timeout", type=float, default=60.0, help="seconds without a turn of the decode loop "
                   "(a step that never ends, a frozen engine) after which the engine counts as failed (0: never)")
    p.add_argument("--engine-restarts", type=int, default=3, help="engine failures (its process or decode loop dead, "
                   "or stalled) recovered by starting a new engine within --engine-restart-window; one more and the "
                   "server exits with status 3 (0: exit at the first)")
    p.add_argument("--engine-restart-window", type=float, default=600.0, help="seconds over which "
                   "--engine-restarts counts")
    p.add_argument("--chat-cache-size", type=int, default=16, help="chat renderers kept, one per distinct "
                   "chat_template_kwargs (least recently used dropped first)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds from arrival (0: none)")
    p.add_argument("--stream-interval", type=float, default=0.02,
                   help="seconds more text of a started stream may wait to go out with the next (fewer, larger SSE "
                   "chunks and fewer event messages from the engine: less CPU for the HTTP process); the first text "
                   "and the end go at once; 0: a chunk per decode step")
    p.add_argument("--stream-chunk-rate", type=float, default=200.0,
                   help="stream chunks a second all requests together should cost: with n in flight, more text "
                   "waits at least n / this many seconds (each chunk is Python work for the HTTP process); "
                   "0: no bound")
    p.add_argument("--max-tokens-limit", type=int, default=2048, help="the largest max_tokens / span accepted")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads of the engine process, set once "
                   "(default: the cores this process may use minus one, at least 1: the HTTP process keeps a core; on "
                   "a GPU machine the forward runs on the device and 1-2 threads suffice for the host side)")
    p.add_argument("--api-key", default=os.environ.get("SETDIFF_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SETDIFF_API_KEY; none: open); several "
                   "keys separated by commas: each a client of its own for fair admission")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds requests in flight may take to finish after SIGTERM / SIGINT")
    p.add_argument("--weights", choices=("ema", "raw"), default=None)
    add_chat_arguments(p)
    add_generation_arguments(p)
    return p.parse_args(argv)


def build(args):
    """The Server for parsed ``args``, its engine process started and the model loaded there (the tests build
    the server in-process through this; :func:`serve` closes the engine)."""
    import json
    from dataclasses import replace

    from setdiff_mega.inference.options import config_from_args
    from setdiff_mega.serving.app import Server
    from setdiff_mega.serving.client import EngineClient
    from setdiff_mega.serving.engine_process import serving_threads
    from setdiff_mega.serving.metrics import HttpMetrics
    from setdiff_mega.serving.protocol import ServerDefaults

    serving_threads(args.threads)                       # a bad --threads is refused before the engine starts
    if args.max_batch < 1 or args.max_queue < 1:
        raise ValueError(f"--max-batch ({args.max_batch}) and --max-queue ({args.max_queue}) must be >= 1")
    if args.max_client_jobs is not None and args.max_client_jobs < 1:
        raise ValueError(f"--max-client-jobs must be >= 1, got {args.max_client_jobs}")
    if args.client_row_share is not None and not 1 <= args.client_row_share <= args.max_batch:
        raise ValueError(f"--client-row-share must be between 1 and --max-batch ({args.max_batch}), got "
                         f"{args.client_row_share}")
    if args.chat_cache_size < 1 or args.engine_restarts < 0 or args.stall_timeout < 0:
        raise ValueError("--chat-cache-size must be >= 1, --engine-restarts and --stall-timeout >= 0")
    if args.static_shapes or args.no_cache:
        raise ValueError("--static-shapes and --no-cache do not apply to the server (its jobs share each step's "
                         "forward); leave them out")
    kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    engine = EngineClient(args, args.max_batch, args.max_queue, args.max_client_jobs, args.stall_timeout,
                          args.engine_restarts, args.engine_restart_window)
    info = engine.start()
    try:
        cfg, tok = info["config"], info["tokenizer"]
        L = cfg.data.seq_length
        base = config_from_args(args, cfg.objective, L)
        defaults = ServerDefaults(cfg.objective, L, replace(base, context_length=base.context_length or L),
                                  max_tokens=base.max_new_tokens, max_tokens_limit=args.max_tokens_limit,
                                  chat_template_kwargs=kwargs)
    except BaseException:
        engine.close()
        raise
    name = args.served_model_name or Path(os.path.abspath(args.checkpoint)).name
    server = Server(engine, tok, defaults, name, HttpMetrics(), timeout=args.request_timeout or None,
                    api_key=args.api_key or None, chat_cache_size=args.chat_cache_size)
    server.method, server.shutdown_grace = info["method"], args.shutdown_grace
    server.decode_weights = info["decode_weights"]          # auto resolved in the engine (inference/engine.py)
    return server


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), so the printed address is the real one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port") from None
    sock.listen(2048)
    return sock


def _draining_server(config):
    """uvicorn's Server, except that SIGTERM / SIGINT drain and return instead of re-raising the signal once
    shut down (uvicorn's default, which kills the process before the scheduler's cleanup: status -15)."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()

    return Draining(config)


def serve(server, sock: socket.socket, announce=None):
    """Run uvicorn on ``sock`` until it stops (SIGINT / SIGTERM: drained, or ``should_exit``), then close the
    engine; returns the uvicorn Server through ``announce`` first (tests stop it from another thread)."""
    import uvicorn

    grace = getattr(server, "shutdown_grace", 30.0)
    config = uvicorn.Config(server.app(), log_level="warning", access_log=False, timeout_graceful_shutdown=grace)
    web = _draining_server(config)
    server.engine.on_fatal = lambda reason: setattr(web, "should_exit", True)     # drain, then exit status 3
    if announce is not None:
        announce(web)
    try:
        web.run(sockets=[sock])
    finally:
        server.engine.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    sock = bind(args.host, args.port)
    server = build(args)
    host, port = sock.getsockname()[:2]
    print(f"serving {server.model_name!r} ({server.method}, context {server.defaults.seq_length}, "
          f"max batch {args.max_batch}, {server.decode_weights} decode weights) on http://{host}:{port}/v1",
          file=sys.stderr, flush=True)
    serve(server, sock)
    if server.engine.fatal:
        print(f"server stopped: the decoding engine failed ({server.engine.fatal}); exit status "
              f"{EXIT_ENGINE_FAILED}", file=sys.stderr, flush=True)
        return EXIT_ENGINE_FAILED
    print("server stopped", file=sys.stderr, flush=True)
    return 0


def cli() -> None:
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
