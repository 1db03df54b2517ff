"""Load generator for the server (``tools/bench_serve.py``): one workload, three ways, in one run.

The workload: ``requests`` prompts from the embedded tasks (math questions and story openings, alternating),
each a streamed greedy completion of ``max_tokens`` tokens (EOS stops off, so every phase does the same work;
the tokens are the same in every phase: greedy decoding is batch-independent).

    sequential   one request at a time (the baseline: decoding without batching, same server, same HTTP)
    concurrent   ``clients`` closed-loop clients (each sends its next request when its previous one ended)
    poisson      open loop: arrivals with exponential gaps at ``rate`` requests/s (seeded)
    hostile      (``--hostile``, alone: :func:`run_hostile`) a well-behaved client's requests one at a time, first
                 unloaded, then beside attackers under another API key (a flood of long requests from several
                 connections, the regex bomb of issue 57, requests of 1,024 jobs, distinct chat_template_kwargs):
                 its p50 / p99 latency both ways and their ratio (the target: p99 within 2x unloaded), the
                 attackers' answers by status, and the server processes' resident memory before and after
                 (the target: within 50 MiB)

Per phase: throughput (generated tokens/s, requests/s over the phase's wall time), latency (request sent -> last
event) and time to first token (-> the first text delta), p50 / p99, and the server's mean decode step by part
(from its /metrics counters before and after the phase: ``setdiff_step_part_seconds_total``; host time = every part
but the model forward), and the CPU time the clients themselves took (they share the machine with the server; they
parse only the chunks they need: the first text and the usage). The ratio printed is concurrent / sequential
throughput. A server is started on a free loopback port unless ``url`` points at a running one.

In-process baseline (:class:`InProcess`): the same prompts through ``setdiff_mega.inference.generate`` in this
process, with the server's decoding options (the checkpoint's defaults, greedy, EOS stop off, the same
max_tokens), at batch 1 and at batch ``clients``, timed the same way (tokens over wall time), while the server
waits idle: the server's share of the model's own speed is sequential / batch 1 and concurrent / batch B. Each
in-process run follows its server phase at once (sequential, batch 1, concurrent, batch B: this machine's speed
drifts by tens of percent over a minute, so a ratio's two sides run seconds apart); with several rounds each
phase reports its median round and the shares are the medians of the rounds' paired ratios (:func:`medians`), as are
the two batching gains: the server's (concurrent / sequential) and the model's own in this process (batch B / batch 1).
"""
from __future__ import annotations

import asyncio
import json
import os
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
            if ttft is not None and '"usage"' not in line and '"error"' not in line:
                continue                 # a later text delta: nothing to read (the client stays light)
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ValueError(f"the server reported: {chunk['error']['message']}")
            if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - t0
    return {"latency": latency, "ttft": latency if ttft is None else ttft, "tokens": tokens}


def scrape(client: httpx.AsyncClient, url: str) -> dict:
    """The server's decode-step counters: {"steps": n, part: seconds} (empty for a server without them)."""
    async def get():
        text = (await client.get(url + "/metrics")).text
        out = {}
        for line in text.splitlines():
            m = re.match(r'setdiff_step_part_seconds_total\{part="(\w+)"\} (\S+)', line)
            if m:
                out[m.group(1)] = float(m.group(2))
            elif line.startswith("setdiff_decode_steps_total "):
                out["steps"] = float(line.split()[1])
        return out
    return get()


def step_parts(before: dict, after: dict) -> dict:
    """Mean decode step by part in ms between two scrapes, and its host time (all but the forward)."""
    n = after.get("steps", 0) - before.get("steps", 0)
    if n <= 0:
        return {}
    ms = {f"step_{k}_ms": 1e3 * (after[k] - before.get(k, 0.0)) / n for k in after if k != "steps"}
    ms["step_host_ms"] = sum(v for k, v in ms.items() if k != "step_forward_ms")
    ms["steps"] = int(n)
    return ms


class InProcess:
    """The in-process baseline (module docstring): the checkpoint loaded once in this process, decoding the
    prompts through ``generate`` with the server's options."""

    def __init__(self, checkpoint: str, max_tokens: int, decode_weights: str = "fp32"):
        from dataclasses import replace

        from setdiff_mega.checkpoint import load_model
        from setdiff_mega.inference.engine import decoding_model
        from setdiff_mega.inference.options import generation_config

        model, self.objective, self.tok, cfg = load_model(checkpoint)
        self.model = decoding_model(model, cfg, self.tok, "auto", decode_weights)
        self.L = cfg.data.seq_length
        self.gc = replace(generation_config(cfg.objective, self.L, None, {"max_new_tokens": max_tokens}),
                          temperature=0.0, stop_at_eos=False)
        self.warm = False

    def run(self, prompts: list[str], batch: int) -> dict:
        """One timed pass over ``prompts`` at ``batch`` (one row)."""
        from dataclasses import replace

        from setdiff_mega.inference import generate

        if not self.warm:
            generate(self.model, self.tok, self.objective, prompts[:1], replace(self.gc, max_new_tokens=2),
                     context=self.L)
            self.warm = True
        t0 = time.perf_counter()
        out = generate(self.model, self.tok, self.objective, prompts, self.gc, context=self.L, batch_size=batch)
        wall = time.perf_counter() - t0
        tokens = sum(r["num_tokens"] for r in out)
        return {"phase": f"in-process batch {batch}", "requests": len(prompts), "wall_s": wall, "tokens": tokens,
                "tokens_per_s": tokens / wall, "requests_per_s": len(prompts) / wall}


def medians(rounds: list[list[dict]], clients: int) -> tuple[list[dict], dict, dict]:
    """Rounds of rows with the same phases -> (per phase the round with the median tokens/s, each row carrying
    every round's tokens/s; the server / in-process shares; the batching gains), each share and gain the median
    over rounds of that round's ratio (paired: the two sides of a ratio ran in the same round, a minute apart at
    most, so a machine whose speed drifts moves both). Gains: ``server`` concurrent / sequential and
    ``in_process`` batch ``clients`` / batch 1, the model's own gain from batching, which bounds the server's."""
    rows = []
    for phase_rows in zip(*rounds):
        ranked = sorted(phase_rows, key=lambda r: r["tokens_per_s"])
        rows.append({**ranked[(len(ranked) - 1) // 2], "rounds_tokens_per_s": [r["tokens_per_s"] for r in phase_rows]})
    conc, b1, bB = f"concurrent x{clients}", "in-process batch 1", f"in-process batch {clients}"
    shares = _paired(rounds, {"sequential_over_batch1": ("sequential", b1),
                              f"concurrent_over_batch{clients}": (conc, bB)})
    gains = _paired(rounds, {"server": (conc, "sequential"), "in_process": (bB, b1)})
    return rows, shares, gains


def _paired(rounds: list[list[dict]], pairs: dict) -> dict:
    """{key: median over rounds of tokens/s of phase num / phase den} for ``pairs`` {key: (num, den)} (keys whose
    phases did not run are left out)."""
    out = {}
    for key, (num, den) in pairs.items():
        ratios = []
        for rs in rounds:
            by = {r["phase"]: r["tokens_per_s"] for r in rs}
            if num in by and den in by:
                ratios.append(by[num] / by[den])
        if ratios:
            out[key] = float(np.median(ratios))
    return out


def summary(name: str, results: list[dict], wall: float, cpu: float | None = None) -> dict:
    """A phase's row; ``cpu``: the CPU seconds this (the clients') process spent in it."""
    lat, ttft = [r["latency"] for r in results], [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"phase": name, "requests": len(results), "wall_s": wall, "tokens": tokens, "client_cpu_s": cpu,
            "tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
            "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


async def run_phases(url: str, bodies: list[dict], clients: int, progress=None, between=None) -> list:
    """The closed-loop phases: sequential, then ``clients`` concurrent clients (rows with the step parts).
    ``between(phase)``, if given, runs right after each phase (the in-process baseline of the same batch size,
    the server idle: a ratio's two sides seconds apart) and returns rows to add after the server's."""
    limits = httpx.Limits(max_connections=max(clients, 64))
    extra = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one(client, url, {**bodies[0], "max_tokens": 2})         # warm-up (not counted)
        out = []
        m0 = await scrape(client, url)
        t0, c0 = time.perf_counter(), time.process_time()
        seq = []
        for b in bodies:
            seq.append(await one(client, url, b))
            progress and progress("sequential", len(seq), len(bodies))
        out.append(summary("sequential", seq, time.perf_counter() - t0, time.process_time() - c0))
        m1 = await scrape(client, url)
        out[-1].update(step_parts(m0, m1))
        extra += between("sequential") if between else []
        pending = list(bodies)
        conc: list = []

        async def worker():
            while pending:
                conc.append(await one(client, url, pending.pop(0)))
                progress and progress(f"concurrent x{clients}", len(conc), len(bodies))
        m1 = await scrape(client, url)
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(clients)))
        out.append(summary(f"concurrent x{clients}", conc, time.perf_counter() - t0, time.process_time() - c0))
        out[-1].update(step_parts(m1, await scrape(client, url)))
        extra += between("concurrent") if between else []
    return out + extra


async def run_poisson(url: str, bodies: list[dict], rate: float, seed: int) -> dict:
    """The open-loop phase: arrivals with exponential gaps at ``rate`` requests/s (seeded)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=64)) as client:
        t0 = time.perf_counter()
        tasks = []
        for b in bodies:
            tasks.append(asyncio.create_task(one(client, url, b)))
            await asyncio.sleep(rng.expovariate(rate))
        return summary(f"poisson {rate:g}/s", list(await asyncio.gather(*tasks)), time.perf_counter() - t0)


REGEX_BOMB = {"prompt": "a" * 27 + "!", "stop_regex": "(a+)+$", "stop_at_eos": False, "max_tokens": 8}


def server_rss(pid: int | None) -> float | None:
    """Resident memory (MiB) of the process ``pid`` and its children (the HTTP process and its engine)."""
    if pid is None:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
        return sum(p.memory_info().rss for p in procs if p.is_running()) / 2 ** 20
    except psutil.Error:
        return None


async def run_hostile(url: str, bodies: list[dict], victim_key: str, attacker_key: str, flood: int = 8,
                      pid: int | None = None, rounds_cap: int = 10_000) -> dict:
    """The hostile phase (module docstring): the victim's ``bodies`` one at a time, unloaded, then again beside
    the attackers (each attacker loop stops when the victim is done, or after ``rounds_cap`` requests).
    Returns a row: the victim's latency both ways, the ratio of p99s, the attackers' statuses, and the resident
    memory (MiB) of the server's processes (``pid`` and its children) before and after the attack."""
    victim = {"Authorization": f"Bearer {victim_key}"}
    attacker = {"Authorization": f"Bearer {attacker_key}"}
    limits = httpx.Limits(max_connections=flood + 16)
    statuses: dict = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def timed(body):
            t = time.perf_counter()
            r = await client.post(url + "/v1/completions", json={**body, "stream": False}, headers=victim)
            if r.status_code != 200:
                raise ValueError(f"the well-behaved client got {r.status_code}: {r.text[:300]}")
            return time.perf_counter() - t

        await timed({**bodies[0], "max_tokens": 2})                 # warm-up
        alone = [await timed(b) for b in bodies]
        rss0 = server_rss(pid)
        done = asyncio.Event()

        flood_tokens = [0]

        async def attack(path, body, flooding=False):
            for _ in range(rounds_cap):
                if done.is_set():
                    return
                try:
                    r = await client.post(url + path, json=body, headers=attacker)
                    key = str(r.status_code)
                except httpx.HTTPError as e:
                    key = type(e).__name__
                statuses[key] = statuses.get(key, 0) + 1
                if flooding and key == "200":
                    flood_tokens[0] += r.json()["usage"]["completion_tokens"]
                if key != "200":
                    await asyncio.sleep(0.01)                       # a refused attacker retries at once, nearly
        long_body = {**bodies[0], "max_tokens": max(64, bodies[0].get("max_tokens", 64)), "stop_at_eos": False}
        attackers = [attack("/v1/completions", long_body, flooding=True) for _ in range(flood)]
        attackers.append(attack("/v1/completions", REGEX_BOMB))
        attackers.append(attack("/v1/completions", {"prompt": ["x"] * 64, "n": 16, "max_tokens": 2}))
        kwargs_count = iter(range(rounds_cap))

        async def chat_flood():
            for i in kwargs_count:
                if done.is_set():
                    return
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                        "chat_template_kwargs": {"attack": i}}
                r = await client.post(url + "/v1/chat/completions", json=body, headers=attacker)
                statuses[f"chat {r.status_code}"] = statuses.get(f"chat {r.status_code}", 0) + 1
        tasks = [asyncio.create_task(a) for a in attackers] + [asyncio.create_task(chat_flood())]
        t_attack = time.perf_counter()
        await asyncio.sleep(0.5)                                    # the flood queued
        try:
            beside = [await timed(b) for b in bodies]
        finally:
            done.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        attack_s = time.perf_counter() - t_attack
        rss1 = server_rss(pid)
    row = {"phase": "hostile", "requests": len(bodies), "attackers": statuses,
           "alone_p50_s": percentile(alone, 50), "alone_p99_s": percentile(alone, 99),
           "beside_p50_s": percentile(beside, 50), "beside_p99_s": percentile(beside, 99),
           "flood_tokens_per_s": flood_tokens[0] / attack_s, "attack_s": attack_s, "alone_s": alone,
           "beside_s": beside}
    row["p99_ratio"] = row["beside_p99_s"] / row["alone_p99_s"]
    if rss0 is not None and rss1 is not None:
        row.update(rss_before_mib=rss0, rss_after_mib=rss1, rss_growth_mib=rss1 - rss0)
    return row


def hostile_table(row: dict) -> str:
    lines = [f"well-behaved client, {row['requests']} requests one at a time: p50 / p99 latency "
             f"{row['alone_p50_s']:.3f} / {row['alone_p99_s']:.3f} s alone, {row['beside_p50_s']:.3f} / "
             f"{row['beside_p99_s']:.3f} s beside the attackers: p99 x{row['p99_ratio']:.2f} (target <= 2)"]
    if "rss_growth_mib" in row:
        lines.append(f"server resident memory {row['rss_before_mib']:.1f} -> {row['rss_after_mib']:.1f} MiB "
                     f"({row['rss_growth_mib']:+.1f} MiB; target within 50)")
    if "flood_tokens_per_s" in row:
        lines.append(f"the flood's {row['flood_tokens_per_s']:.1f} generated tokens/s over the attack's "
                     f"{row['attack_s']:.1f} s (what the row share costs it)")
    lines.append("attackers' answers: " + ", ".join(f"{k}: {v}" for k, v in sorted(row["attackers"].items())))
    return "\n".join(lines)


def start_server(checkpoint: str, max_batch: int, extra: list[str], tree: Path | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """``tools/serve.py`` on a free loopback port; returns (process, base URL) once it answers /health. ``tree``:
    another checkout whose ``tools/serve.py`` and package run instead (its root first on PYTHONPATH)."""
    root = Path(tree) if tree is not None else Path(__file__).resolve().parents[2]
    env = None if tree is None else {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, str(root / "tools" / "serve.py"), "--checkpoint", checkpoint, "--port",
                             "0", "--max-batch", str(max_batch), *extra], stderr=subprocess.PIPE, text=True, env=env)
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
            if httpx.get(url + "/health", timeout=2).status_code == 200:     # /health needs no API key
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise ValueError("the server did not answer /health within 120 s")


def table(rows: list[dict]) -> str:
    head = ("| phase | requests | tokens/s | requests/s | latency p50 / p99 (s) | TTFT p50 / p99 (s) | step ms: host "
            "(admit / calls / fuse / advance) + forward | clients' CPU / wall |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lat = (f"{r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}"
               if "latency_p50_s" in r else "- | -")
        step = "-"
        if "step_host_ms" in r:
            host = " / ".join(f"{r.get('step_' + k + '_ms', 0.0):.2f}" for k in ("admit", "calls", "fuse", "advance"))
            step = f"{r['step_host_ms']:.2f} ({host}) + {r.get('step_forward_ms', 0.0):.2f}"
        cpu = f"{r['client_cpu_s'] / r['wall_s']:.0%}" if r.get("client_cpu_s") is not None else "-"
        lines.append(f"| {r['phase']} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | "
                     f"{lat} | {step} | {cpu} |")
    return "\n".join(lines)


__all__ = ["workload", "run_phases", "start_server", "summary", "table", "percentile", "step_parts",
           "scrape", "InProcess", "medians", "run_poisson", "run_hostile", "hostile_table", "server_rss"]
