"""Decoding benchmarks: tokens/s, NFE and tokens/step per sampler setting, measured in one process.

Protocol (method.md 7, P21): batch size 1, per-example tokens/s = generated tokens / wall time (prefill
included), averaged over examples after ``warmup`` untimed examples. Every setting runs on the same
model and the same prompts, so ratios between settings are meaningful on any machine.

:func:`step_breakdown` splits a decode step into the model forward and the sampler's own work (the
same code for every engine): it times every model call, then decodes again with each forward
replaced by random logits of the same shape (same number of steps when one token is committed per
step and EOS does not stop: tau >= 1, ``stop_at_eos=False``).

:func:`speculative_comparison` (issue 59, method.md 16): on the same prompts and checkpoint, AR mode (SetDLM at
W = 1 with the head shift), SetDLM's threshold decoding at its best setting of a small grid and self-speculative
decoding, interleaved: tokens/s at batch 1 and batch B, tokens per forward, the distribution of acceptance lengths,
draft acceptance by window position, and whether the speculative tokens equal AR mode's on every prompt.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from setdiff_mega import methods
from setdiff_mega.decoding.base import Canvas, GenerationConfig

from .api import build_sampler, encode_request


@dataclass
class BenchRow:
    method: str
    window: int
    tau: float
    block_size: int
    use_cache: bool
    max_new_tokens: int
    tokens_per_s: float
    tokens_per_s_std: float
    nfe: float
    tokens_per_step: float
    tokens: float

    def as_dict(self):
        return asdict(self)


def measure(model, tokenizer, method: str, prompts: list, config: GenerationConfig, warmup: int = 1) -> BenchRow:
    """Run ``prompts`` one at a time (batch 1) and summarise speed and parallelism."""
    sampler = build_sampler(method, model, tokenizer, config)
    ids = [encode_request(tokenizer, p) for p in prompts]
    dev = next(model.parameters()).device
    for p in ids[:warmup]:
        sampler.generate(Canvas.from_prompts([p], tokenizer.mask, tokenizer.pad, config.max_new_tokens, device=dev))
    tps, nfe, tps_step, ntok = [], [], [], []
    for p in ids:
        canvas = Canvas.from_prompts([p], tokenizer.mask, tokenizer.pad, config.max_new_tokens, device=dev)
        t0 = time.perf_counter()
        out = sampler.generate(canvas)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n = len(out.tokens[0])
        tps.append(n / dt)
        nfe.append(out.nfe)
        tps_step.append(out.tokens_per_step[0])
        ntok.append(n)
    rec = methods.get(method)
    return BenchRow(method=method, window=config.window if rec.window else 0, tau=config.tau,
                    block_size=config.block_size if rec.block else 0,
                    use_cache=config.use_cache if rec.cached else False,
                    max_new_tokens=config.max_new_tokens, tokens_per_s=statistics.mean(tps),
                    tokens_per_s_std=statistics.pstdev(tps), nfe=statistics.mean(nfe),
                    tokens_per_step=statistics.mean(tps_step), tokens=statistics.mean(ntok))


def compare_engines(engines: dict, tokenizer, cases: list, repeats: int = 3) -> list[dict]:
    """Decoding speed of the same settings on several engines (``{"native": model, "plain": model}``),
    interleaved (engine order alternates every repeat, so slow phases of a shared machine hit both) and
    summarised by the median tokens/s per engine; ``cases``: (label, method, prompts, config). Each
    row also says whether the engines generated identical tokens."""
    return [_interleaved({n: (m, cfg) for n, m in engines.items()}, tokenizer, label, method, prompts, repeats)
            for label, method, prompts, cfg in cases]


def compare_settings(model, tokenizer, cases: list, variants: dict, repeats: int = 3) -> list[dict]:
    """The same model under several variants of each case's config (``{"off": {"record": False}, "on":
    {"record": True}}``: field overrides), interleaved as :func:`compare_engines`; rows as there, with
    ``<variant>_tokens_per_s`` and, for two variants, ``speedup`` = second / first."""
    return [_interleaved({n: (model, replace(cfg, **over)) for n, over in variants.items()}, tokenizer, label,
                         method, prompts, repeats) for label, method, prompts, cfg in cases]


def _interleaved(runners: dict, tokenizer, label: str, method: str, prompts: list, repeats: int) -> dict:
    """One comparison row: every runner ``name -> (model, config)`` measured ``repeats`` times, the order
    alternating every repeat; the median tokens/s per runner and whether their tokens are identical."""
    names = list(runners)
    runs = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            model, cfg = runners[n]
            runs[n].append(measure(model, tokenizer, method, prompts, cfg, warmup=1 if r == 0 else 0))
    outs = {n: _tokens(runners[n][0], tokenizer, method, prompts, runners[n][1]) for n in names}
    cfg = runners[names[0]][1]
    row = {"case": label, "method": method, "window": cfg.window, "tau": cfg.tau, "block_size": cfg.block_size,
           "max_new_tokens": cfg.max_new_tokens, "prompts": len(prompts),
           **{f"{n}_tokens_per_s": statistics.median(m.tokens_per_s for m in runs[n]) for n in names},
           "tokens_per_step": runs[names[0]][0].tokens_per_step,
           "identical_tokens": all(outs[n] == outs[names[0]] for n in names)}
    if len(names) == 2:
        row["speedup"] = row[f"{names[1]}_tokens_per_s"] / row[f"{names[0]}_tokens_per_s"]
    return row


def _tokens(model, tokenizer, method, prompts, cfg) -> list:
    sampler = build_sampler(method, model, tokenizer, cfg)
    dev = next(model.parameters()).device
    return [sampler.generate(Canvas.from_prompts([encode_request(tokenizer, p)], tokenizer.mask, tokenizer.pad,
                                                 cfg.max_new_tokens, device=dev)).tokens[0] for p in prompts]


class TimedModel:
    """A model for the samplers whose calls are timed (``seconds``, ``calls``). With ``stub_vocab`` = V each
    forward returns random logits [B, T - logits_start, V] instead (the cache's chunk slots are reserved as
    a real forward would), so a decode measures the sampler's own work. Everything else is the model's."""

    def __init__(self, model, stub_vocab: int | None = None):
        self._model, self._stub = model, stub_vocab
        self._cache, self.seconds, self.calls, self.vocab, self.widths = None, 0.0, 0, None, []
        self._gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)

    def __getattr__(self, name):
        return getattr(self._model, name)

    @contextlib.contextmanager
    def use_cache(self, cache):
        self._cache = cache
        try:
            with self._model.use_cache(cache):
                yield cache
        finally:
            self._cache = None

    def __call__(self, tokens, position_ids, keep, logits_start: int = 0, **kwargs):
        t0 = time.perf_counter()
        if self._stub is None:
            out = self._model(tokens, position_ids, keep, logits_start, **kwargs)   # valid= for a ragged model
            self.vocab = out.shape[-1]
        else:
            if self._cache is not None:
                self._cache.begin(tokens.shape[1])
            out = torch.randn(tokens.shape[0], tokens.shape[1] - logits_start, self._stub, generator=self._gen,
                              device=tokens.device)
        if tokens.is_cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.widths.append(tokens.shape[1])
        return out


def step_breakdown(engines: dict, tokenizer, method: str, prompts: list, cfg: GenerationConfig,
                   repeats: int = 3) -> dict:
    """Per model call (ms), per engine: the whole step, the forward inside it, and the sampler's own work
    (forwards stubbed); engines interleaved, the fastest repeat kept (see the module docstring)."""
    out = {n: [] for n in engines}
    for r in range(repeats):
        for n in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            if r == 0:
                measure(engines[n], tokenizer, method, prompts[:1], cfg, warmup=0)
            timed = TimedModel(engines[n])
            t0 = time.perf_counter()
            measure(timed, tokenizer, method, prompts, cfg, warmup=0)
            wall = time.perf_counter() - t0
            stub = TimedModel(engines[n], stub_vocab=timed.vocab)
            t0 = time.perf_counter()
            measure(stub, tokenizer, method, prompts, cfg, warmup=0)
            own = time.perf_counter() - t0 - stub.seconds
            out[n].append({"calls": timed.calls, "step_ms": 1e3 * wall / timed.calls,
                           "forward_ms": 1e3 * timed.seconds / timed.calls,
                           "sampler_ms": 1e3 * own / max(stub.calls, 1), "stub_calls": stub.calls})
    return {n: min(rows, key=lambda x: x["step_ms"]) for n, rows in out.items()}


def same_chunk(model, tokenizer, prompts: list, size: int, new_tokens: int, repeats: int = 3,
               methods_: tuple | None = None) -> dict:
    """Per decode step (ms) of SetDLM (W = ``size``) and BD3LM (S = ``size``) on the same model and chunk:
    tau = 0 commits every active position, so after the prefill every forward of both is ``size`` pending +
    ``size`` query rows; a step is timed from one step's end to the next (the first, which holds the prefill, is
    left out), its forward inside it, and the rest is the sampler's own work. Methods interleaved per repeat,
    the fastest repeat kept. Returns {method: {step_ms, forward_ms, sampler_ms, steps, chunk}}."""
    from setdiff_mega.diffusion.bd3lm import BD3LM
    from setdiff_mega.diffusion.setdlm import SETDLM

    methods_ = methods_ or (SETDLM.name, BD3LM.name)
    out = {m: [] for m in methods_}
    dev = next(model.parameters()).device
    ids = [encode_request(tokenizer, p) for p in prompts]
    for r in range(repeats + 1):                              # the first round warms up
        for m in (methods_ if r % 2 == 0 else methods_[::-1]):
            cfg = GenerationConfig(max_new_tokens=new_tokens, window=size, block_size=size, tau=0.0,
                                   stop_at_eos=False)
            timed = TimedModel(model)
            sampler = build_sampler(m, timed, tokenizer, cfg)
            marks, fwd, widths = [], [], set()
            sampler.observer = lambda st: marks.append((time.perf_counter(), timed.seconds, timed.calls))
            for p in ids:
                marks.clear()
                sampler.generate(Canvas.from_prompts([p], tokenizer.mask, tokenizer.pad, new_tokens, device=dev))
                (t0, f0, c0), (t1, f1, c1) = marks[0], marks[-1]
                fwd.append((t1 - t0, f1 - f0, c1 - c0))
                widths |= set(timed.widths[c0:c1])
            wall, f, n = (sum(x[i] for x in fwd) for i in range(3))
            if r:
                out[m].append({"step_ms": 1e3 * wall / n, "forward_ms": 1e3 * f / n,
                               "sampler_ms": 1e3 * (wall - f) / n, "steps": n, "chunk": sorted(widths)})
    return {m: min(rows, key=lambda x: x["step_ms"]) for m, rows in out.items()}


def default_grid(base: GenerationConfig, windows=(1, 2, 4, 8), taus=(1e6, 0.9, 0.7, 0.5),
                 bd3_blocks=(2, 4, 8), mdlm_block=32):
    """(method, config) pairs: SetDLM W x tau, BD3LM block sizes (tau = 0.9), AR, MDLM."""
    grid = [("setdlm", replace(base, window=w, tau=t)) for w in windows for t in taus]
    grid += [("bd3lm", replace(base, block_size=s, tau=0.9)) for s in bd3_blocks]
    grid += [("ar", replace(base, tau=1e6)), ("mdlm", replace(base, block_size=mdlm_block, tau=0.9))]
    return grid


def plot_speed_vs_tau(rows: list[BenchRow], path) -> None:
    import matplotlib  # gated: the backend is chosen before pyplot is imported (headless machines)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    set_rows = [r for r in rows if methods.get(r.method).window and r.use_cache]
    for w in sorted({r.window for r in set_rows}):
        rs = sorted((r for r in set_rows if r.window == w), key=lambda r: -min(r.tau, 1.0))
        x = [min(r.tau, 1.0) for r in rs]
        a1.plot(x, [r.tokens_per_s for r in rs], "o-", label=f"SetDLM W={w}")
        a2.plot(x, [r.tokens_per_step for r in rs], "o-", label=f"SetDLM W={w}")
    for r in rows:
        if not methods.get(r.method).window:
            lab = r.method.upper() + (f" S={r.block_size}" if r.block_size else "")
            a1.axhline(r.tokens_per_s, ls="--", lw=0.8, color="gray")
            a1.annotate(lab, (0.02, r.tokens_per_s), fontsize=7, xycoords=("axes fraction", "data"))
    a1.set_xlabel("tau (1.0 = one token per step)")
    a1.set_ylabel("tokens / s (batch 1)")
    a2.set_xlabel("tau")
    a2.set_ylabel("tokens / step")
    for a in (a1, a2):
        a.invert_xaxis()
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle("SetDLM decoding: speed against the commit threshold")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _decode_once(model, tokenizer, method: str, ids: list, config: GenerationConfig, batch: int):
    """Decode ``ids`` in batches of ``batch``: (wall seconds, generated tokens, outputs per batch)."""
    sampler = build_sampler(method, model, tokenizer, config)
    dev = next(model.parameters()).device
    outs, seconds, n = [], 0.0, 0
    for s in range(0, len(ids), batch):
        canvas = Canvas.from_prompts(ids[s:s + batch], tokenizer.mask, tokenizer.pad, config.max_new_tokens, device=dev)
        t0 = time.perf_counter()
        out = sampler.generate(canvas)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        n += sum(len(t) for t in out.tokens)
        outs.append(out)
    return seconds, n, outs


def speculative_comparison(model, tokenizer, method: str, prompts: list, base: GenerationConfig,
                           windows=(4, 8), thresholds=((4, 0.9), (4, 0.7), (4, 0.5)), batches=(1, 8),
                           repeats: int = 3) -> dict:
    """AR mode, the best threshold setting and speculative decoding on the same prompts (module docstring). Timing:
    every setting decoded ``repeats`` times per batch size, the order alternating every repeat (slow phases of a
    shared machine hit every setting); tokens/s = generated tokens / wall time (prefill included), the median over
    repeats. Speculative statistics come from the batch-1 decodes: tokens per forward = generated tokens / decode
    forwards (prefill excluded), the histogram of tokens committed per (row, forward), drafts verified / accepted by
    their distance k from the exact token, the fraction of (row, forward) pairs that verified drafts."""
    ids = [encode_request(tokenizer, p) for p in prompts]
    greedy = replace(base, temperature=0.0)
    settings = {"ar_mode": replace(greedy, window=1, tau=2.0, commit_rule="leftmost")}
    settings.update({f"threshold_W{w}_tau{t:g}": replace(greedy, window=w, tau=t) for w, t in thresholds})
    settings.update({f"speculative_W{w}": replace(greedy, window=w, speculative=True) for w in windows})
    names = list(settings)
    speed = {n: {b: [] for b in batches} for n in names}
    outs = {n: {} for n in names}
    for r in range(repeats + 1):                     # round 0: warm-up (untimed), keeps the outputs
        for n in (names if r % 2 == 0 else names[::-1]):
            for b in batches:
                sec, tok, got = _decode_once(model, tokenizer, method, ids, settings[n], b)
                if r == 0:
                    outs[n][b] = got
                else:
                    speed[n][b].append(tok / sec)
    tokens = {n: {b: [t for o in outs[n][b] for t in o.tokens] for b in batches} for n in names}
    ar = tokens["ar_mode"][1]
    rows = {}
    for n in names:
        one = outs[n][1]
        counts = [c for o in one for h in o.history for c in h if c > 0]
        row = {"options": {k: getattr(settings[n], k) for k in ("window", "tau", "speculative")},
               **{f"tokens_per_s_batch{b}": statistics.median(speed[n][b]) for b in batches},
               **{f"tokens_per_s_batch{b}_best": max(speed[n][b]) for b in batches},   # a shared machine: best-of
               "tokens_per_forward": sum(counts) / max(1, len(counts)),
               "forwards_batch1": sum(o.nfe for o in one) / len(one),
               "identical_to_ar_mode": all(tokens[n][b] == ar for b in batches),
               "prompts_equal_to_ar_mode": sum(a == t for a, t in zip(ar, tokens[n][1]))}
        if settings[n].speculative:
            verified = [sum(x) for x in zip(*(o.speculation["verified"] for o in one))]
            accepted = [sum(x) for x in zip(*(o.speculation["accepted"] for o in one))]
            row["acceptance_lengths"] = {k: counts.count(k) for k in range(1, settings[n].window + 1)}
            row["draft_acceptance_by_position"] = {k: {"verified": verified[k], "accepted": accepted[k],
                                                       "rate": accepted[k] / verified[k] if verified[k] else None}
                                                   for k in range(1, settings[n].window)}
            # one query group per possible accepted prefix (method.md 16): a forward lacks drafts only at a row's
            # first decode step or where the window is cut (context budget, end of the generation)
            row["forwards_with_drafts"] = (verified[1] if len(verified) > 1 else 0) / max(1, len(counts))
        rows[n] = row
    best_thr = max((n for n in names if n.startswith("threshold")), key=lambda n: rows[n]["tokens_per_s_batch1"])
    best_spec = max((n for n in names if n.startswith("speculative")), key=lambda n: rows[n]["tokens_per_s_batch1"])
    ar_row = rows["ar_mode"]
    return {"prompts": len(prompts), "max_new_tokens": base.max_new_tokens, "repeats": repeats, "settings": rows,
            "best_threshold": best_thr, "best_speculative": best_spec,
            "speculative_speedup_batch1": rows[best_spec]["tokens_per_s_batch1"] / ar_row["tokens_per_s_batch1"],
            "speculative_speedup_batch1_best": rows[best_spec]["tokens_per_s_batch1_best"]
            / ar_row["tokens_per_s_batch1_best"],
            **{f"speculative_speedup_batch{b}": rows[best_spec][f"tokens_per_s_batch{b}"]
               / ar_row[f"tokens_per_s_batch{b}"] for b in batches if b != 1}}


def plot_acceptance(report: dict, path) -> None:
    """The distribution of acceptance lengths (tokens committed per forward) of every speculative setting, and the
    draft acceptance rate by window position."""
    import matplotlib  # gated: the backend is chosen before pyplot is imported (headless machines)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = {n: r for n, r in report["settings"].items() if "acceptance_lengths" in r}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / max(1, len(spec))
    for i, (n, r) in enumerate(spec.items()):
        ks = sorted(int(k) for k in r["acceptance_lengths"])
        total = sum(r["acceptance_lengths"].values()) or 1
        a.bar([k + i * width for k in ks], [r["acceptance_lengths"][k] / total for k in ks], width,
              label=f"{n} (mean {r['tokens_per_forward']:.2f})")
        pos = sorted(int(k) for k in r["draft_acceptance_by_position"])
        b.plot(pos, [r["draft_acceptance_by_position"][k]["accepted"]
                     / max(1, r["draft_acceptance_by_position"][k]["verified"]) for k in pos], "o-", label=n)
    a.set_xlabel("tokens committed per forward (accepted drafts + 1)")
    a.set_ylabel("fraction of forwards")
    a.legend(fontsize=8)
    b.set_xlabel("draft position k in the window (k = 1: right after the exact token)")
    b.set_ylabel("accepted / verified")
    b.set_ylim(0, 1)
    b.legend(fontsize=8)
    fig.suptitle(f"self-speculative decoding: {report['prompts']} prompts, batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["BenchRow", "TimedModel", "measure", "compare_engines", "compare_settings", "step_breakdown", "default_grid",
           "plot_speed_vs_tau", "speculative_comparison", "plot_acceptance"]
