"""Load generator for the server (``tools/bench_serve.py``): one workload, three ways, in one run.

The workload: ``requests`` prompts from the embedded tasks (math questions and story openings, alternating),
each a streamed greedy completion of ``max_tokens`` tokens (EOS stops off, so every phase does the same work;
the tokens are the same in every phase: greedy decoding is batch-independent).

    sequential   one request at a time (the baseline: decoding without batching, same server, same HTTP)
    concurrent   ``clients`` closed-loop clients (each sends its next request when its previous one ended)
    poisson      open loop: arrivals with exponential gaps at ``rate`` requests/s (seeded)

Per phase: throughput (generated tokens/s, requests/s over the phase's wall time), latency (request sent ->
last event) and time to first token (-> the first text delta), p50 / p99. The ratio printed is concurrent /
sequential throughput. A server is started on a free loopback port unless ``url`` points at a running one.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np


def workload(task_dir: str, n: int) -> list[str]:
    """``n`` prompts: held-out math questions and story openings, alternating (cycled when too few)."""
    root = Path(task_dir)
    if not (root / "math.jsonl").is_file() or not (root / "stories.jsonl").is_file():
        raise FileNotFoundError(f"'{root}' has no math.jsonl / stories.jsonl; run tools/prepare_data.py --embedded "
                                f"first, or pass --tasks")
    math = [json.loads(x) for x in (root / "math.jsonl").read_text().splitlines() if x.strip()]
    stories = [json.loads(x) for x in (root / "stories.jsonl").read_text().splitlines() if x.strip()]
    pool = []
    for m, s in zip(math, stories):
        pool += [f"Question: {m['question']}\nAnswer:", " ".join(s["sentences"][:2])]
    return [pool[i % len(pool)] for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (linear interpolation; NaN for no values)."""
    return float(np.percentile(values, q)) if values else float("nan")


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """A streamed completion: latency, time to first token, generated tokens (from the usage chunk)."""
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise ValueError(f"the server answered {r.status_code}: {(await r.aread()).decode()[:300]} (prompts from "
                             f"--tasks must fit the model's context)")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ValueError(f"the server reported: {chunk['error']['message']}")
            if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - t0
    return {"latency": latency, "ttft": latency if ttft is None else ttft, "tokens": tokens}


def summary(name: str, results: list[dict], wall: float) -> dict:
    lat, ttft = [r["latency"] for r in results], [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"phase": name, "requests": len(results), "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
            "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


async def run_phases(url: str, bodies: list[dict], clients: int, rate: float | None, seed: int, progress=None) -> list:
    limits = httpx.Limits(max_connections=max(clients, 64))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one(client, url, {**bodies[0], "max_tokens": 2})         # warm-up (not counted)
        out = []
        t0 = time.perf_counter()
        seq = []
        for b in bodies:
            seq.append(await one(client, url, b))
            progress and progress("sequential", len(seq), len(bodies))
        out.append(summary("sequential", seq, time.perf_counter() - t0))
        pending = list(bodies)
        conc: list = []

        async def worker():
            while pending:
                conc.append(await one(client, url, pending.pop(0)))
                progress and progress(f"concurrent x{clients}", len(conc), len(bodies))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        out.append(summary(f"concurrent x{clients}", conc, time.perf_counter() - t0))
        if rate:
            rng = random.Random(seed)
            t0 = time.perf_counter()
            tasks = []
            for b in bodies:
                tasks.append(asyncio.create_task(one(client, url, b)))
                await asyncio.sleep(rng.expovariate(rate))
            out.append(summary(f"poisson {rate:g}/s", list(await asyncio.gather(*tasks)), time.perf_counter() - t0))
    return out


def start_server(checkpoint: str, max_batch: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``tools/serve.py`` on a free loopback port; returns (process, base URL) once it answers /health."""
    tool = Path(__file__).resolve().parents[2] / "tools" / "serve.py"
    proc = subprocess.Popen([sys.executable, str(tool), "--checkpoint", checkpoint, "--port", "0", "--max-batch",
                             str(max_batch), *extra], stderr=subprocess.PIPE, text=True)
    url = None
    for line in proc.stderr:
        m = re.search(r"on (http://[^/\s]+)/v1", line)
        if m:
            url = m.group(1)
            break
        if line.startswith("error:"):
            break
    if url is None:
        proc.kill()
        raise ValueError(f"the server did not start: {line.strip() if 'line' in locals() else 'no output'}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise ValueError("the server did not answer /health within 120 s")


def table(rows: list[dict]) -> str:
    head = "| phase | requests | tokens/s | requests/s | latency p50 / p99 (s) | TTFT p50 / p99 (s) |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | "
                     f"{r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} |")
    return "\n".join(lines)


__all__ = ["workload", "run_phases", "start_server", "summary", "table", "percentile"]
