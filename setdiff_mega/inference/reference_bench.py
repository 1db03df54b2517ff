"""Side-by-side decoding against the reference implementation (issue 44; ``tools/bench_reference.py``).

What it measures: this project's plain engine (:func:`~setdiff_mega.inference.engine.decoding_model`, "plain")
and the reference's ``SetDLM.generate`` (kuleshov-group/setdlms, unmodified, in its own venv:
``scripts/setup_reference.sh``) decoding the same random-weight DiT, the same token-id prompts (batch 1) with
the same options (SetDLM, window W, threshold tau, KV cache, greedy), one thread in each process. Per decode:
generated tokens, wall time (prefill included) and forwards (NFE, the prefill counted on both sides);
per side and round, tokens/s = tokens / seconds and ms per forward = 1000 seconds / NFE over all prompts (the
sampler's own work per step included); the report gives the median over rounds, the ratios ours / reference,
and the fraction of generated tokens that are identical (position by position).

The model: a DiT release (the reference's names and layout, :mod:`setdiff_mega.checkpoint.adapters.dit`) written
once into ``OUT/release-<digest of its spec>`` with seeded random values: embedding N(0, 1) [V, d]; per block
LayerNorm weights 1 + N(0, 0.1^2) [d], attn_qkv [3d, d], attn_out [d, d], mlp.0 [4d, d] + bias [4d], mlp.2 [d, 4d]
+ bias [d], each weight N(0, 1 / fan_in) (context-dependent outputs, no near-ties between positions); the head [V,
d] N(0, s^2 / d) with s = ``logit_std``, so logits are about N(0, s^2) and some confidences pass tau 0.9 (random
heads of the usual scale never do). The reference loads it into its SetDLM; this side imports it through the DiT
adapter (:func:`~setdiff_mega.checkpoint.families.load_family`: reference names -> native, bit-exact both ways,
tests/model/test_dit_release.py) and builds the plain twin.

Rounds alternate the order (ours, reference, reference, ours, ...) so a slow phase of the machine hits both;
each side first decodes one prompt untimed. The reference's worker is a persistent subprocess speaking JSON
lines (:mod:`.reference_worker`); ``self_test`` runs that worker with this project's engine instead.

The commit rule differs at tau < 1: the reference forces k = round(t_i N) - round(t_next N) commits per step
with t_i = 1 - i / N indexed by the step i but t_next by the tokens generated so far (``first_hitting``), so
k = 1 + (tokens committed beyond one per step so far): every extra threshold commit raises the forced count of
every later step. This project forces k = 1 (method.md P11). At tau >= 1 both commit one token per step. For
tau < 1 the runner ``ours_reference_k`` also decodes with that k schedule (the sampler's ``commit_k`` set after
every step through its observer), which reproduces the reference's tokens (identical on the main job's shape
and the tests' tiny one).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from setdiff_mega.checkpoint import families
from setdiff_mega.config import load_config
from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.errors import ConfigError
from setdiff_mega.outputs import staged_dir, usual_mode

from .api import build_sampler
from .engine import decoding_model

P = "backbone."
WORKER = Path(__file__).with_name("reference_worker.py")
MAIN_VOCAB = 2048                  # the embedded corpus' tokenizer (tools/prepare_data.py --vocab-size default)
RELEASE_FORMAT = 1                 # bump when release_tensors changes what a seed gives


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    vocab: int                     # rows of the embedding and head, MASK (the last id) included
    length: int                    # L: the training length, the reference's block size
    D: int                         # the order prior's D (S_max = 2D): only the configs need it

    def check(self) -> "Shape":
        if min(asdict(self).values()) < 1 or self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ConfigError(f"--shape {self}: every field must be >= 1 and hidden a multiple of heads with an "
                              f"even head size")
        if self.vocab < 8 or 2 * self.D > self.length:
            raise ConfigError(f"--shape {self}: needs vocab >= 8 and 2D <= L")
        return self


SHAPES = {"gpt2": Shape(layers=12, hidden=768, heads=12, vocab=50258, length=1024, D=4)}   # GPT-2 small + MASK


def parse_shape(spec: str, main_config: str | Path = "configs/tiny_cpu.yaml") -> Shape:
    """``gpt2`` (the default), ``main`` (the main job's model, data.seq_length and D from ``main_config``; the
    embedded tokenizer's vocabulary) or ``LAYERS,HIDDEN,HEADS,VOCAB,L,D``."""
    if spec in SHAPES:
        return SHAPES[spec]
    if spec == "main":
        cfg = load_config(main_config)
        m = cfg.model
        return Shape(m.num_layers, m.hidden_size, m.num_attention_heads, MAIN_VOCAB, cfg.data.seq_length,
                     int(getattr(cfg.objective, "D", 4))).check()
    try:
        shape = Shape(*(int(x) for x in spec.split(",")))
    except (TypeError, ValueError):
        raise ConfigError(f"--shape {spec!r} must be gpt2, main or LAYERS,HIDDEN,HEADS,VOCAB,L,D "
                          f"(e.g. 12,768,12,50258,1024,4)") from None
    return shape.check()


def release_tensors(shape: Shape, seed: int, logit_std: float) -> dict:
    """The release's tensors in the reference's names (values: the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    normal = lambda *size, std: torch.randn(*size, generator=g) * std       # noqa: E731
    d, f, V = shape.hidden, 4 * shape.hidden, shape.vocab
    t = {P + "vocab_embed.embedding": normal(V, d, std=1.0)}
    for i in range(shape.layers):
        b = f"{P}blocks.{i}."
        t.update({b + "norm1.weight": 1 + normal(d, std=0.1), b + "attn_qkv.weight": normal(3 * d, d, std=d ** -0.5),
                  b + "attn_out.weight": normal(d, d, std=d ** -0.5), b + "norm2.weight": 1 + normal(d, std=0.1),
                  b + "mlp.0.weight": normal(f, d, std=d ** -0.5), b + "mlp.0.bias": normal(f, std=0.1),
                  b + "mlp.2.weight": normal(d, f, std=f ** -0.5), b + "mlp.2.bias": normal(d, std=0.1)})
    t.update({P + "output_layer.norm_final.weight": 1 + normal(d, std=0.1),
              P + "output_layer.linear.weight": normal(V, d, std=logit_std * d ** -0.5),
              P + "output_layer.linear.bias": normal(V, std=0.1)})
    return t


def _tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer.json of vocab - 1 tokens (EOS = BOS = PAD = 0); MASK (vocab - 1) is the
    release's config ``mask_token_id``, added on import as the tests' releases do."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, vocab - 1)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))


def ensure_release(parent: Path, shape: Shape, seed: int, logit_std: float, say=print) -> Path:
    """The release of (shape, seed, logit_std) in ``parent/release-<digest of that spec>``: reused when there,
    else written once through a staging directory renamed into place (a content-keyed cache; nothing replaced)."""
    spec = {"format": RELEASE_FORMAT, "shape": asdict(shape), "seed": seed, "logit_std": logit_std}
    d = Path(parent) / f"release-{hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]}"
    if d.exists():
        if not ((d / "model.safetensors").is_file() and json.loads((d / "spec.json").read_text()) == spec):
            raise ConfigError(f"'{d}' does not hold the release its name promises; remove it and run again")
        say(f"reusing the release in {d}")
        return d
    say(f"writing a random-weight DiT release {asdict(shape)} to {d}")
    with staged_dir(d, "bench_reference") as tmp:
        save_file(release_tensors(shape, seed, logit_std), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        usual_mode(tmp / "model.safetensors")
        V, L = shape.vocab, shape.length
        config = {"model_type": "bd3lm", "architectures": ["BD3LM"], "length": L, "vocab_size": V,
                  "mask_token_id": V - 1, "eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0,
                  "noise_config": {"desired_block_size": shape.D, "max_block_size": 2 * shape.D, "length": L},
                  "backbone_config": {"n_heads": shape.heads, "dropout": 0.1, "length": L, "adaln": False}}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _tokenizer(tmp / "tokenizer.json", V)
        (tmp / "spec.json").write_text(json.dumps(spec, indent=2) + "\n")
    return d


def prompts_for(shape: Shape, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` fixed prompts of ``length`` ids in [1, V - 1) (neither EOS nor MASK), from ``seed``."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(1, shape.vocab - 1, (length,), generator=g).tolist() for _ in range(count)]


class OursSide:
    """This project's plain engine on the release (see the module docstring); ``generate`` as the worker's."""

    def __init__(self, release: Path, decode_weights=("fp32",)):
        import transformers

        decode_weights = (decode_weights,) if isinstance(decode_weights, str) else tuple(decode_weights)
        L = json.loads((Path(release) / "config.json").read_text())["length"]
        native, cfg, self.tok, _ = families.load_family(release, overrides=[f"data.seq_length={L}"])
        self.models = {f: decoding_model(native, cfg, self.tok, "plain", f) for f in decode_weights}
        self.L, self.formats = L, decode_weights
        self.info = {"side": "ours", "engine": "plain", "decode_weights": ",".join(decode_weights),
                     "transformers": transformers.__version__,
                     "parameters": sum(p.numel() for p in native.parameters())}

    def generate(self, prompt: list, max_new_tokens: int, window: int, tau: float, k_schedule: str = "ours",
                 fmt: str | None = None) -> dict:
        """``k_schedule`` "reference": the reference's forced count per step (the module docstring); ``fmt``: the
        decode-weights format (default: the first)."""
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, window=window, tau=tau, commit_k=1,
                               commit_rule="confidence", use_cache=True, context_length=self.L, stop_at_eos=False)
        sampler = build_sampler("setdlm", self.models[fmt or self.formats[0]], self.tok, cfg)
        if k_schedule == "reference":
            sampler.observer = lambda st: setattr(cfg, "commit_k", int(st.committed[0] - st.steps[0]) + 1)
        canvas = Canvas.from_prompts([prompt], self.tok.mask, self.tok.pad, max_new_tokens)
        t0 = time.perf_counter()
        out = sampler.generate(canvas)
        dt = time.perf_counter() - t0
        return {"tokens": [int(x) for x in out.tokens[0]], "seconds": dt, "nfe": int(out.nfe)}


class WorkerError(ValueError):
    """The worker process failed or exited: one line with its last log line (a user-facing error)."""


class Worker:
    """The worker subprocess (:mod:`.reference_worker`): JSON lines in and out, its stderr in ``log``."""

    def __init__(self, python: str, args: list, log: Path, threads: int):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.log = Path(log)
        self._err = open(self.log, "w")
        self.proc = subprocess.Popen([python, str(WORKER), *args, "--threads", str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            tail = [x for x in self.log.read_text().splitlines() if x.strip()][-1:] or ["(no output)"]
            raise WorkerError(f"the reference worker exited with status {self.proc.returncode}: {tail[0][:300]} "
                               f"(full log: {self.log})")
        msg = json.loads(line)
        if "error" in msg:
            raise WorkerError(f"the reference worker failed: {msg['error']} (log: {self.log})")
        return msg

    def generate(self, prompt: list, max_new_tokens: int, window: int, tau: float) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_new_tokens": max_new_tokens, "window": window,
                                          "tau": tau}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def _decode_all(fn, prompts: list) -> dict:
    """One side's pass over every prompt: totals and the generated tokens."""
    outs = [fn(p) for p in prompts]
    sec, nfe = sum(o["seconds"] for o in outs), sum(o["nfe"] for o in outs)
    n = sum(len(o["tokens"]) for o in outs)
    return {"seconds": sec, "nfe": nfe, "tokens": n, "tokens_per_s": n / sec, "ms_per_forward": 1e3 * sec / nfe,
            "outputs": [o["tokens"] for o in outs]}


def agreement(a: list, b: list) -> dict:
    """Position-by-position agreement of two sides' generated tokens (lists of per-prompt lists)."""
    same = sum(x == y for pa, pb in zip(a, b) for x, y in zip(pa, pb))
    total = sum(max(len(pa), len(pb)) for pa, pb in zip(a, b))
    first = next(((i, j) for i, (pa, pb) in enumerate(zip(a, b)) for j, (x, y) in enumerate(zip(pa, pb)) if x != y),
                 None)
    return {"fraction": same / max(total, 1), "identical": same == total,
            "first_difference": None if first is None else {"prompt": first[0], "position": first[1]}}


def compare_setting(runners: dict, prompts: list, rounds: int, tick=lambda name: None) -> dict:
    """Every runner ``name -> fn(prompt) -> {tokens, seconds, nfe}`` over all prompts, ``rounds`` times, the
    order reversed every other round after one untimed warm-up decode each; medians, ratios, agreement."""
    names = list(runners)
    for n in names:
        runners[n](prompts[0])
    runs, order = {n: [] for n in names}, []
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            runs[n].append(_decode_all(runners[n], prompts))
            order.append(n)
            tick(n)
    row = {"order": order}
    for n in names:
        rs = runs[n]
        steps = rs[0]["nfe"] - len(prompts)                      # one prefill forward per decode
        row[n] = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                  "ms_per_forward": statistics.median(x["ms_per_forward"] for x in rs),
                  "nfe_per_decode": rs[0]["nfe"] / len(prompts), "tokens_per_step": rs[0]["tokens"] / max(steps, 1),
                  "deterministic": all(x["outputs"] == rs[0]["outputs"] for x in rs),
                  "rounds": [{k: x[k] for k in ("seconds", "nfe", "tokens", "tokens_per_s", "ms_per_forward")}
                             for x in rs]}
    ref = runs["reference"][0]["outputs"]
    for n in names:
        if n != "reference":
            row[f"{n}_over_reference"] = {"tokens_per_s": row[n]["tokens_per_s"] / row["reference"]["tokens_per_s"],
                                          "ms_per_forward": row[n]["ms_per_forward"]
                                          / row["reference"]["ms_per_forward"]}
            row[f"{n}_agreement"] = agreement(runs[n][0]["outputs"], ref)
    return row


def check_reference(ref_dir, ref_venv) -> tuple[Path, Path]:
    """(REF_DIR, the venv's python), or one line naming the flag and the setup command."""
    fix = "fetch kuleshov-group/setdlms and run scripts/setup_reference.sh REF_DIR [VENV]"
    if ref_dir is None:
        raise ConfigError(f"--ref-dir is required (a work tree of the reference; --self checks the harness without "
                          f"it): {fix}")
    if not (Path(ref_dir) / "src" / "denoiser" / "setdlm.py").is_file():
        raise ConfigError(f"--ref-dir '{ref_dir}' is not a setdlms work tree (no src/denoiser/setdlm.py): {fix}")
    py = Path(ref_venv) / "bin" / "python"
    if not py.is_file() or not (Path(ref_venv) / ".setdiff-reference-installed").is_file():
        raise ConfigError(f"--ref-venv '{ref_venv}' is not the reference's environment (no bin/python or no "
                          f"install stamp): run scripts/setup_reference.sh {ref_dir} {ref_venv}")
    return Path(ref_dir).resolve(), py


def git_commit(d: Path | None) -> str | None:
    """The commit of a git work tree ``d`` (None for an exported tree: the worker's file hashes identify it)."""
    if d is None or not (d / ".git").exists():
        return None
    r = subprocess.run(["git", "-C", str(d), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or None if r.returncode == 0 else None


def check_options(shape: Shape, taus, windows, rounds: int, num_prompts: int, prompt_length: int,
                  max_new_tokens: int) -> None:
    """The run's numbers, each refused with one line naming its flag."""
    if prompt_length < 1 or max_new_tokens < 1 or prompt_length + max_new_tokens > shape.length:
        raise ConfigError(f"--prompt-length {prompt_length} + --max-new-tokens {max_new_tokens} must be >= 2 and fit "
                          f"L = {shape.length} (no cache eviction on either side)")
    if rounds < 1 or num_prompts < 1:
        raise ConfigError("--rounds and --num-prompts must be >= 1")
    if not taus or not windows or min(windows) < 1 or min(taus) < 0:
        raise ConfigError(f"--taus {taus} and --windows {windows} need at least one value each, tau >= 0, W >= 1")


def run(out: Path, shape: Shape, *, ref_dir=None, ref_venv=None, self_test: bool = False, taus=(1e6, 0.9),
        windows=(8,), rounds: int = 3, num_prompts: int = 3, prompt_length: int = 32, max_new_tokens: int = 64,
        seed: int = 0, logit_std: float = 8.0, threads: int = 1, decode_weights=("fp32",), say=print,
        tick=lambda name: None) -> dict:
    """The whole benchmark into ``out`` (already claimed): release, both sides, every (W, tau); returns the report
    (also written to ``out/reference.json``)."""
    if self_test:
        python, worker_args, ref = sys.executable, ["--self"], None
    else:
        ref, py = check_reference(ref_dir, ref_venv)
        python, worker_args = str(py), ["--ref-dir", str(ref)]
    check_options(shape, taus, windows, rounds, num_prompts, prompt_length, max_new_tokens)
    load = os.getloadavg()
    release = ensure_release(out, shape, seed, logit_std, say)
    torch.set_num_threads(threads)
    prompts = prompts_for(shape, num_prompts, prompt_length, seed)
    say(f"loading both sides ({'self-test worker' if self_test else 'reference worker: ' + python})")
    ours = OursSide(release, decode_weights)
    worker = Worker(python, ["--release", str(release), *worker_args], out / "worker.log", threads)
    try:
        rows = []
        for W in windows:
            for tau in taus:
                runners = {"ours": lambda p, W=W, tau=tau: ours.generate(p, max_new_tokens, W, tau),
                           "reference": lambda p, W=W, tau=tau: worker.generate(p, max_new_tokens, W, tau)}
                for f in ours.formats[1:]:                        # further decode-weights formats of our side
                    runners[f"ours_{f}"] = lambda p, W=W, tau=tau, f=f: ours.generate(p, max_new_tokens, W, tau,
                                                                                      fmt=f)
                if tau < 1:
                    for f in ours.formats:
                        name = "ours_reference_k" + ("" if f == ours.formats[0] else f"_{f}")
                        runners[name] = lambda p, W=W, tau=tau, f=f: ours.generate(p, max_new_tokens, W, tau,
                                                                                   "reference", f)
                say(f"W = {W}, tau = {tau:g}: {rounds} rounds of {', '.join(runners)}")
                rows.append({"window": W, "tau": tau, **compare_setting(runners, prompts, rounds, tick)})
    finally:
        worker.close()
    report = {"tool": "bench_reference", "shape": asdict(shape), "seed": seed, "logit_std": logit_std,
              "threads": threads, "rounds": rounds, "max_new_tokens": max_new_tokens, "prompts": prompts,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "load_average_before": [round(x, 2) for x in load],
              "load_average_after": [round(x, 2) for x in os.getloadavg()],
              "ours": {**ours.info, "torch": torch.__version__},
              "reference": {**worker.info, "dir": ref and str(ref), "commit": git_commit(ref)}, "settings": rows}
    (out / "reference.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "reference.txt").write_text(table(report) + "\n")
    return report


def table(report: dict) -> str:
    """The report's short table: per setting and runner, tokens/s, ms per forward, NFE, tokens/step, the ratios
    to the reference and the token agreement."""
    s = report["shape"]
    lines = [f"shape {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, V {s['vocab']}, L {s['length']}; "
             f"{len(report['prompts'])} prompts x {report['max_new_tokens']} new tokens, batch 1, "
             f"{report['threads']} thread(s), median of {report['rounds']} rounds; ours: plain engine, "
             f"{report['ours'].get('decode_weights', 'fp32')} weights; load average "
             f"{report['load_average_before'][0]:.2f} -> {report['load_average_after'][0]:.2f}",
             f"{'W':>3} {'tau':>7} {'side':17} {'tok/s':>9} {'ms/fwd':>8} {'NFE':>6} {'tok/step':>8} "
             f"{'tok/s/ref':>9} {'ms/fwd/ref':>10} {'same tokens':>11}"]
    for row in report["settings"]:
        for n in [k for k in row if isinstance(row[k], dict) and "nfe_per_decode" in row[k]]:
            r, x, a = row[n], row.get(f"{n}_over_reference"), row.get(f"{n}_agreement")
            ratio = f"{x['tokens_per_s']:9.3f} {x['ms_per_forward']:10.3f}" if x else " " * 20
            agree = f"{100 * a['fraction']:10.1f}%" if a else ""
            lines.append(f"{row['window']:>3} {row['tau']:>7g} {n:17} {r['tokens_per_s']:9.1f} "
                         f"{r['ms_per_forward']:8.3f} {r['nfe_per_decode']:6.1f} {r['tokens_per_step']:8.2f} "
                         f"{ratio} {agree}")
    return "\n".join(lines)


__all__ = ["Shape", "SHAPES", "parse_shape", "release_tensors", "ensure_release", "prompts_for", "OursSide", "Worker",
           "WorkerError", "agreement", "compare_setting", "check_reference", "check_options", "git_commit", "run",
           "table"]
