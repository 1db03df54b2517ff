"""Paired A/B throughput of two servers on one machine (``tools/bench_serve.py --against REF``).

A 2-core machine's speed drifts by several percent over minutes (issue 57 measured two runs of the same code 5.7 %
apart), more than the 3 % a serving change may cost, so two runs one after the other resolve nothing. Here both
servers are started at once (A: this checkout; B: the checkout ``REF``, a directory or a git revision checked out
into a temporary worktree) and take turns on the same workload, in short rounds ordered A B, B A, A B, ... (each
pair's two rounds seconds apart; the order alternates so that a trend within a pair cancels over pairs). While one
server is measured the other is idle.

Per phase p (sequential, concurrent) and pair i, the paired log ratio ``d_i = ln(tok/s_A / tok/s_B)``; over n pairs

    mean ratio  = exp(mean d)
    95 % CI     = exp(mean d +- t_{0.975, n-1} * sd(d) / sqrt(n))
    resolution  = t_{0.975, n-1} * sd(d) / sqrt(n)      (the smallest relative difference the design resolves)

and the verdict against a tolerance tol (default 3 %): ``within`` when the whole CI lies above 1 - tol (A is not
slower than B by more than tol), ``slower`` when it lies below, ``not resolved`` otherwise. The rows hold every
round's tokens/s, so a reader can redo the statistics.

Hostile comparison (``--hostile --client-row-share auto,2,1 --hostile-runs K``, :func:`run_hostile_compare`): one
server per row-share setting, all started at once, and K runs of the hostile phase on each, the settings' order
rotated every run (so drift spreads over all of them). Per setting: every run's p99 ratio (beside / alone), the
flood's generated tokens/s (what a smaller share costs the flood) and the memory growth, with mean and sd.

One run's p99 of n = 64 requests is its second-worst latency: one stall of the shared machine decides it (issue 57
measured x1.49 to x2.85 across four runs of one setting). The verdict therefore pools the K runs' latencies and asks
the target's own question, "at most 1 % of the well-behaved client's requests beside the attack take more than 2x its
unloaded p99", as a count:

    reference    = p99 of the pooled unloaded latencies (n K requests)
    exceedances  = k of the n K pooled latencies beside the attack above 2 x reference
    95 % CI      = the exact (Clopper-Pearson) binomial interval of k / (n K)

with the pooled p99 ratio beside it, and the verdict ``holds`` when the interval's upper end is at most 1 %,
``missed`` when its lower end is above 1 %, ``not resolved`` otherwise (one stall is one exceedance, not the
verdict; more runs narrow the interval: ``holds`` needs n K >= 367 requests with no exceedance, 555 with one,
720 with two).
"""
from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .bench import run_hostile, run_phases, start_server

PHASES = ("sequential", "concurrent")


def paired_stats(a: list[float], b: list[float], tol: float = 0.03) -> dict:
    """The statistics of the module docstring for paired tokens/s ``a`` (A's rounds) and ``b`` (B's)."""
    from scipy import stats

    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"paired statistics need at least two pairs of equal length, got {len(a)} and {len(b)}")
    d = np.log(np.asarray(a, float) / np.asarray(b, float))
    n = len(d)
    half = float(stats.t.ppf(0.975, n - 1) * d.std(ddof=1) / math.sqrt(n))
    mean = float(d.mean())
    lo, hi = math.exp(mean - half), math.exp(mean + half)
    verdict = "within" if lo >= 1 - tol else "slower" if hi < 1 - tol else "not resolved"
    return {"pairs": n, "ratio": math.exp(mean), "ci_low": lo, "ci_high": hi, "resolution": half,
            "sd_log_ratio": float(d.std(ddof=1)), "tolerance": tol, "verdict": verdict}


def git_root(where: Path) -> Path:
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=where, capture_output=True, text=True)
    if out.returncode != 0:
        raise ValueError(f"--against names a git revision but '{where}' is not in a git checkout: pass a directory "
                         f"holding the other checkout instead")
    return Path(out.stdout.strip())


@contextmanager
def checkout(ref: str, repo: Path | None = None):
    """The root of the checkout ``ref``: an existing directory as it is, or a git revision of ``repo`` (default:
    this checkout) added as a detached worktree under a new temporary directory, removed (worktree and directory,
    both made here) on exit."""
    if Path(ref).is_dir():
        root = Path(ref).resolve()
        if not (root / "tools" / "serve.py").is_file() or not (root / "setdiff_mega").is_dir():
            raise ValueError(f"--against '{ref}' holds no tools/serve.py and setdiff_mega/: pass the root of "
                             f"another checkout of this project, or a git revision")
        yield root
        return
    repo = git_root(Path(repo) if repo is not None else Path(__file__).resolve().parent)
    rev = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=repo,
                         capture_output=True, text=True)
    if rev.returncode != 0:
        raise ValueError(f"--against '{ref}' is neither a directory nor a revision of {repo}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_ab_"))
    tree = tmp / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev.stdout.strip()], cwd=repo,
                   check=True, capture_output=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
        if tmp.exists() and not any(tmp.iterdir()):
            tmp.rmdir()


def check_imports_own(tree: Path) -> None:
    """The other checkout's server must run its own package, not this one's editable install: imported the way
    :func:`.bench.start_server` starts it (the script's directory first, then PYTHONPATH = the tree)."""
    code = "import setdiff_mega; print(setdiff_mega.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tree / "tools",
                         env={**os.environ, "PYTHONPATH": str(tree)})
    got = Path(out.stdout.strip()).resolve() if out.returncode == 0 else None
    if got is None or Path(tree).resolve() not in got.parents:
        raise ValueError(f"the checkout '{tree}' does not import its own setdiff_mega (got {got}): its server would "
                         f"run this checkout's code")


def run_ab(checkpoint: str, tree: Path, bodies: list[dict], clients: int, extra: list[str], pairs: int,
           tol: float = 0.03, log=print) -> dict:
    """Both servers up, ``pairs`` pairs of rounds in alternating order (module docstring); returns the rounds and
    per phase the paired statistics."""
    check_imports_own(tree)
    procs = []
    try:
        pa, url_a = start_server(checkpoint, clients, extra)
        procs.append(pa)
        pb, url_b = start_server(checkpoint, clients, extra, tree=tree)
        procs.append(pb)
        rounds = {"A": [], "B": []}
        for i in range(pairs):
            order = ("A", "B") if i % 2 == 0 else ("B", "A")
            for side in order:
                rows = asyncio.run(run_phases(url_a if side == "A" else url_b, bodies, clients))
                rounds[side].append({p: r["tokens_per_s"] for p, r in zip(PHASES, rows)})
            log(f"pair {i + 1}/{pairs}: " + ", ".join(
                f"{p} A/B {rounds['A'][-1][p] / rounds['B'][-1][p]:.3f}" for p in PHASES))
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
    stats = {p: paired_stats([r[p] for r in rounds["A"]], [r[p] for r in rounds["B"]], tol) for p in PHASES}
    return {"rounds": rounds, "stats": stats, "pairs": pairs, "clients": clients}


def run_hostile_compare(checkpoint: str, shares: list, bodies: list[dict], clients: int, extra: list[str],
                        runs: int, keys: tuple[str, str], flood: int, log=print) -> dict:
    """One server per row share (None: the server's default rule), ``runs`` rotated runs of the hostile phase on
    each (module docstring); {"rows": {share label: [row, ...]}, "summary": {label: {...}}}."""
    procs, urls = [], {}
    labels = [share_label(x) for x in shares]
    try:
        for x, label in zip(shares, labels):
            more = [] if x is None else ["--client-row-share", str(x)]
            proc, urls[label] = start_server(checkpoint, clients, [*extra, *more])
            procs.append((label, proc))
        pids = {label: proc.pid for label, proc in procs}
        rows: dict = {label: [] for label in labels}
        for r in range(runs):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                row = asyncio.run(run_hostile(urls[label], bodies, keys[0], keys[1], flood, pids[label]))
                rows[label].append(row)
                log(f"run {r + 1}/{runs}, row share {label}: p99 x{row['p99_ratio']:.2f}, flood "
                    f"{row['flood_tokens_per_s']:.1f} tok/s, memory {row.get('rss_growth_mib', float('nan')):+.1f} MiB")
    finally:
        for _, p in procs:
            p.terminate()
            p.wait(timeout=30)
    return {"rows": rows, "summary": {k: hostile_summary(v) for k, v in rows.items()}, "runs": runs}


def share_label(x) -> str:
    return "default" if x is None else str(x)


def pooled_p99(rows: list[dict], target: float = 2.0, share: float = 0.01) -> dict:
    """The pooled p99 ratio of the runs ``rows`` (their ``alone_s`` / ``beside_s`` latencies) and the exceedance
    count against ``target`` x the pooled unloaded p99, its exact 95 % interval and the verdict (module docstring)."""
    from scipy import stats

    if not rows or any(not r.get("alone_s") or not r.get("beside_s") for r in rows):
        raise ValueError("a pooled p99 needs every run's alone and beside latencies")
    alone = np.concatenate([np.asarray(r["alone_s"], float) for r in rows])
    beside = np.concatenate([np.asarray(r["beside_s"], float) for r in rows])
    ref = float(np.percentile(alone, 100 * (1 - share)))
    k, n = int((beside > target * ref).sum()), len(beside)
    ci = stats.binomtest(k, n).proportion_ci(0.95, method="exact")
    verdict = "holds" if ci.high <= share else "missed" if ci.low > share else "not resolved"
    return {"ratio": float(np.percentile(beside, 100 * (1 - share))) / ref, "reference_s": ref, "exceedances": k,
            "requests": n, "runs": len(rows), "share_low": float(ci.low), "share_high": float(ci.high),
            "target": target, "verdict": verdict}


def hostile_summary(rows: list[dict]) -> dict:
    out = {}
    if rows and all("alone_s" in r and "beside_s" in r for r in rows):
        out["pooled_p99"] = pooled_p99(rows)
    for key in ("p99_ratio", "alone_p99_s", "beside_p99_s", "flood_tokens_per_s", "rss_growth_mib"):
        v = [r[key] for r in rows if key in r]
        if v:
            out[key] = {"mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"),
                        "max": float(np.max(v)), "runs": v}
    return out


def hostile_compare_table(result: dict) -> str:
    lines = ["| row share | p99 ratio per run | mean +- sd (max) | pooled p99 ratio; requests over 2x the unloaded p99 "
             "(95 % CI): verdict at 1 % | the flood's tok/s, mean +- sd | memory growth, max (MiB) |",
             "|---|---|---|---|---:|---:|"]
    for label, s in result["summary"].items():
        r, f = s["p99_ratio"], s["flood_tokens_per_s"]
        mem = f"{s['rss_growth_mib']['max']:+.1f}" if "rss_growth_mib" in s else "-"
        q = s.get("pooled_p99")
        pooled = (f"x{q['ratio']:.2f}; {q['exceedances']} of {q['requests']} over 2x ({q['share_low']:.1%}-"
                  f"{q['share_high']:.1%}): {q['verdict']}") if q else "-"
        lines.append(f"| {label} | {', '.join(f'x{v:.2f}' for v in r['runs'])} | x{r['mean']:.2f} +- {r['sd']:.2f} "
                     f"(x{r['max']:.2f}) | {pooled} | {f['mean']:.1f} +- {f['sd']:.1f} | {mem} |")
    return "\n".join(lines)


def ab_table(result: dict, label_b: str) -> str:
    lines = [f"| phase | A (this checkout) tok/s, mean | B ({label_b}) tok/s, mean | A / B (95 % CI) | resolves | "
             f"verdict (tolerance) |", "|---|---:|---:|---|---:|---|"]
    for p, s in result["stats"].items():
        a = np.mean([r[p] for r in result["rounds"]["A"]])
        b = np.mean([r[p] for r in result["rounds"]["B"]])
        name = p if p == "sequential" else f"concurrent x{result['clients']}"
        lines.append(f"| {name} | {a:.1f} | {b:.1f} | {s['ratio']:.3f} ({s['ci_low']:.3f}-{s['ci_high']:.3f}) | "
                     f"{s['resolution']:.1%} | {s['verdict']} ({s['tolerance']:.0%}) |")
    return "\n".join(lines)


__all__ = ["paired_stats", "pooled_p99", "checkout", "run_ab", "ab_table", "PHASES", "run_hostile_compare",
           "hostile_summary", "hostile_compare_table", "share_label"]
