#!/usr/bin/env python
"""Benchmark the server: sequential (one request at a time, the baseline), concurrent clients (closed loop)
and Poisson arrivals (open loop) over one workload of embedded-task prompts, in one run
(setdiff_mega/serving/bench.py).

    python tools/bench_serve.py --checkpoint runs/tiny_cpu --clients 8 --requests 32 --max-tokens 64
    python tools/bench_serve.py --url http://127.0.0.1:8000 --clients 8     # a server already running

Prints throughput (tokens/s, requests/s), p50 / p99 latency and time to first token per phase, the server's
mean decode step by part (host time: admission, the samplers' bookkeeping, fusion; and the model forward), the
clients' CPU share, and the ratio of concurrent to sequential throughput. With --checkpoint the same prompts
also run in-process through ``generate`` at batch 1 and at batch --clients (the server idle, same threads),
in --rounds rounds alternating with the server's phases (each phase: its median round; the server's shares,
sequential / batch 1 and concurrent / batch B, the concurrency ratio and the model's own in-process gain, batch
B / batch 1, beside it: the medians of the rounds' paired ratios); --no-in-process skips that. --json writes the
rows.

    python tools/bench_serve.py --checkpoint runs/tiny_cpu --hostile --requests 16 --max-tokens 16

    python tools/bench_serve.py --checkpoint runs/tiny_cpu --against 1b0d2a2 --pairs 10

--against REF: paired A/B throughput of this checkout's server against the checkout REF (a directory, or a git
revision checked out into a temporary worktree that is removed afterwards): both servers up, short rounds in
alternating order, the mean ratio with its 95 % CI, the smallest difference the design resolves and a verdict
against --tolerance (setdiff_mega/serving/bench_ab.py).

--hostile runs the hostile phase alone (issue 57; setdiff_mega/serving/bench.py run_hostile): a well-behaved
client's p50 / p99 latency unloaded and beside attackers (a flood, the regex bomb, 1,024-job requests, distinct
chat kwargs) under another API key, and the server's resident memory before and after. With --checkpoint the
server is started with the two keys (--hostile-keys); with --url, the server must accept them. With several
--client-row-share values (e.g. default,2,1) or --hostile-runs K > 1, one server per value, K runs each in rotated
order: every run's p99 ratio, the flood's tokens/s (what a smaller share costs it) and the memory growth.
"""
import argparse
import asyncio
import json
import sys

import torch
from tqdm import tqdm

from setdiff_mega.cli import run_cli
from setdiff_mega.hfmodel.linears import AUTO, CHOICES, resolve
from setdiff_mega.outputs import check_output_file, write_file_atomic
from setdiff_mega.serving.bench import (
    InProcess,
    hostile_table,
    medians,
    run_hostile,
    run_phases,
    run_poisson,
    start_server,
    table,
    workload,
)
from setdiff_mega.serving.bench_ab import ab_table, checkout, hostile_compare_table, run_ab, run_hostile_compare
from setdiff_mega.serving.engine_process import serving_threads


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="start tools/serve.py on this checkpoint (a free loopback port)")
    src.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=8,
                   help="concurrent closed-loop clients (the started server's --max-batch)")
    p.add_argument("--requests", type=int, default=32, help="requests per phase")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rate", default="auto", help="Poisson arrivals per second; 'auto': 0.75 x the concurrent "
                   "phase's requests/s; 0: skip the phase")
    p.add_argument("--tasks", default="data/embedded/tasks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="the started server's torch threads (default: the "
                   "server's, cores minus one), also the in-process baseline's")
    p.add_argument("--decode-weights", choices=CHOICES, default=AUTO, help="the decode weights format of the "
                   "started server and of the in-process baseline (tools/generate.py's option; auto is resolved here, "
                   "so every server, --against's included, gets the same format)")
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process generate baseline")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (server sequential + concurrent, in-process "
                   "batch 1 + batch B), alternating; each phase reports its median round, the shares the median "
                   "of the rounds' paired ratios")
    p.add_argument("--hostile", action="store_true", help="run the hostile phase alone (module docstring)")
    p.add_argument("--hostile-keys", default="victim,attacker", help="the well-behaved client's and the attackers' "
                   "API keys (a started server gets both)")
    p.add_argument("--flood", type=int, default=8, help="the hostile phase's concurrent flooding connections")
    p.add_argument("--client-row-share", default=None, help="the started server's --client-row-share; --hostile: "
                   "a comma-separated list compares several ('default': the server's own rule), e.g. default,2,1")
    p.add_argument("--hostile-runs", type=int, default=1, help="--hostile: runs per row-share setting (rotated)")
    p.add_argument("--against", default=None, help="paired A/B throughput against another checkout: a directory "
                   "or a git revision (module docstring)")
    p.add_argument("--pairs", type=int, default=10, help="--against: pairs of rounds (A B, then B A, ...)")
    p.add_argument("--tolerance", type=float, default=0.03, help="--against: the slowdown the verdict allows")
    p.add_argument("--json", help="write the phases' rows here")
    p.add_argument("--overwrite", action="store_true")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        raise ValueError("--clients, --requests and --max-tokens must be >= 1")
    if args.json:
        check_output_file(args.json, [args.checkpoint], flag="--json", overwrite=args.overwrite)
    threads = serving_threads(args.threads)             # the started server's and the in-process baseline's
    args.decode_weights = resolve(args.decode_weights)  # one format for all (an older --against tree knows no auto)
    shares = row_shares(args.client_row_share)
    if (args.against or args.hostile_runs > 1 or len(shares) > 1) and not args.checkpoint:
        raise ValueError("--against, --hostile-runs and several --client-row-share values start their own servers: "
                         "pass --checkpoint, not --url")
    if args.hostile:
        return hostile(args, threads, shares)
    if args.against:
        return against(args, threads)
    bodies = [{"prompt": q, "max_tokens": args.max_tokens, "temperature": 0, "stop_at_eos": False, "stream": True,
               "stream_options": {"include_usage": True}} for q in workload(args.tasks, args.requests)]
    proc = None
    if args.checkpoint:
        extra = ["--threads", str(threads), "--decode-weights", args.decode_weights]
        proc, url = start_server(args.checkpoint, args.clients, extra)
    else:
        url = args.url.rstrip("/")
    bars: dict = {}

    def progress(phase, done, total):
        bar = bars.get(phase) or bars.setdefault(phase, tqdm(total=total, desc=phase, unit="req", file=sys.stderr))
        bar.update(done - bar.n)
    local = None
    if args.checkpoint and not args.no_in_process:
        torch.set_num_threads(threads)
        local = InProcess(args.checkpoint, args.max_tokens, args.decode_weights)
    prompts, rounds = [b["prompt"] for b in bodies], []
    try:
        def baseline(phase):                        # the server waits idle while this process decodes
            return [local.run(prompts, 1 if phase == "sequential" else args.clients)] if local else []
        for r in range(args.rounds):
            rounds.append(asyncio.run(run_phases(url, bodies, args.clients, progress, baseline)))
            for bar in bars.values():
                bar.close()
            bars.clear()
        rows, shares, gains = medians(rounds, args.clients)
        rate = None if args.rate == "auto" else float(args.rate)
        if rate != 0:                               # open-loop arrivals: once, after the rounds
            auto = 0.75 * rows[1]["requests_per_s"] if rate is None else rate
            rows.insert(2, asyncio.run(run_poisson(url, bodies, auto, args.seed)))
    finally:
        for bar in bars.values():
            bar.close()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(table(rows))
    ratio = gains.get("server", rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    own = f" (in-process batch {args.clients} / batch 1: {gains['in_process']:.2f}x)" if "in_process" in gains else ""
    print(f"concurrent x{args.clients} / sequential throughput: {ratio:.2f}x{own}")
    for k, v in shares.items():
        print(f"server / in-process, {k.replace('_', ' ')}: {v:.1%}")
    if args.json:
        write_file_atomic(args.json, json.dumps({"rows": rows, "ratio": ratio, "shares": shares, "gains": gains,
                                                 "clients": args.clients, "requests": args.requests,
                                                 "max_tokens": args.max_tokens}, indent=1))
    return 0


def row_shares(text: str | None) -> list:
    """--client-row-share's values: None for 'default' (the server's rule), else integers >= 1."""
    if text is None:
        return [None]
    out = []
    for part in text.split(","):
        part = part.strip()
        if part in ("default", "auto"):
            out.append(None)
        elif part.isdigit() and int(part) >= 1:
            out.append(int(part))
        else:
            raise ValueError(f"--client-row-share takes integers >= 1 or 'default', comma-separated; got {part!r}")
    return out


def against(args, threads: int) -> int:
    """--against: paired A/B throughput (setdiff_mega/serving/bench_ab.py)."""
    if args.pairs < 2:
        raise ValueError(f"--pairs must be >= 2 (a spread needs two pairs), got {args.pairs}")
    bodies = [{"prompt": q, "max_tokens": args.max_tokens, "temperature": 0, "stop_at_eos": False, "stream": True,
               "stream_options": {"include_usage": True}} for q in workload(args.tasks, args.requests)]
    extra = ["--threads", str(threads), "--decode-weights", args.decode_weights]
    with checkout(args.against) as tree:
        result = run_ab(args.checkpoint, tree, bodies, args.clients, extra, args.pairs, args.tolerance,
                        log=lambda m: print(m, file=sys.stderr))
    print(ab_table(result, args.against))
    if args.json:
        write_file_atomic(args.json, json.dumps({**result, "against": args.against, "requests": args.requests,
                                                 "max_tokens": args.max_tokens}, indent=1))
    return 0


def hostile(args, threads: int, shares: list) -> int:
    """The hostile phase alone (module docstring)."""
    keys = [k.strip() for k in args.hostile_keys.split(",")]
    if len(keys) != 2 or not all(keys):
        raise ValueError(f"--hostile-keys must be two keys separated by a comma, got {args.hostile_keys!r}")
    bodies = [{"prompt": q, "max_tokens": args.max_tokens, "temperature": 0, "stop_at_eos": False}
              for q in workload(args.tasks, args.requests)]
    extra = ["--threads", str(threads), "--decode-weights", args.decode_weights, "--api-key", ",".join(keys)]
    if args.hostile_runs > 1 or len(shares) > 1:
        result = run_hostile_compare(args.checkpoint, shares, bodies, args.clients, extra, max(args.hostile_runs, 1),
                                     tuple(keys), args.flood, log=lambda m: print(m, file=sys.stderr))
        print(hostile_compare_table(result))
        if args.json:
            write_file_atomic(args.json, json.dumps({**result, "clients": args.clients, "requests": args.requests,
                                                     "max_tokens": args.max_tokens}, indent=1))
        return 0
    proc = None
    if args.checkpoint:
        if shares[0] is not None:
            extra += ["--client-row-share", str(shares[0])]
        proc, url = start_server(args.checkpoint, args.clients, extra)
    else:
        url = args.url.rstrip("/")
    try:
        row = asyncio.run(run_hostile(url, bodies, keys[0], keys[1], args.flood, proc.pid if proc else None))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(hostile_table(row))
    if args.json:
        write_file_atomic(args.json, json.dumps({"rows": [row], "clients": args.clients, "requests": args.requests,
                                                 "max_tokens": args.max_tokens}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
