#!/usr/bin/env python
"""Training throughput benchmark on one GPU (not a test): step time, MFU and tokens/s per attention backend.

    python tools/bench_train_gpu.py [--preset 350m] [--seq-lengths 1024 2048] [--out-dir runs/bench_train_gpu]

For a ~350M-parameter model (24 x 1024, GPT-2 medium shape) at each L, in one run: AR with causal
attention, SetDLM with each attention backend (dense-mask SDPA, FlexAttention, the mask-free set-causal
decomposition), and with FP8 linears (torchao; Transformer Engine's FP8 where installed: ``--fp8 te``);
and set-causal attention forward + backward against two causal calls of length L (the baseline measured
in the same run; measured first, as it is quick). Writes bench_attention.csv, bench_train.csv (both row by
row), summary.json and mfu.png.
See :mod:`benchmarks.training` for the definitions (MFU counts processed tokens).

``--device cpu --preset tiny`` runs the same code on a CPU in seconds (a smoke run; no MFU there).
"""
import argparse
import dataclasses
import json
import sys

import _checkout  # noqa: F401  (benchmarks/ is not installed)
import torch
from tqdm import tqdm

from benchmarks.training import (
    DEFAULT_SETTINGS,
    bench_attention,
    bench_train_step,
    kernel_backends,
    plot_mfu,
)
from setdiff_mega.cli import run_cli
from setdiff_mega.diffusion.setdlm import SETDLM
from setdiff_mega.eval.sweep import write_csv
from setdiff_mega.outputs import claim_output_dir, either, holds_only, marked_by
from setdiff_mega.parallel import initialize


def _write_csv(path, rows):
    write_csv([dataclasses.asdict(r) for r in rows], path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="350m", choices=["350m", "tiny"])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[1024, 2048], help="L (SetDLM processes 2L)")
    p.add_argument("--tokens-per-step", type=int, default=32768, help="processed tokens per step (all settings)")
    p.add_argument("--settings", nargs="*", default=None,
                   help="labels to run (default: all of benchmarks.training.DEFAULT_SETTINGS)")
    p.add_argument("--fp8", default="torchao", choices=["torchao", "te"], help="FP8 route of the +fp8 settings")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--attention-batch", type=int, default=None,
                   help="batch of the attention benchmark (default: tokens-per-step / 2L)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--out-dir", default="runs/bench_train_gpu")
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    initialize(seed=1234, backend="nccl" if device.type == "cuda" else "gloo")
    settings = [s for s in DEFAULT_SETTINGS if args.settings is None or s[0] in args.settings]
    if not settings:
        raise ValueError(f"no setting matches --settings {args.settings}; labels: {[s[0] for s in DEFAULT_SETTINGS]}")
    if args.fp8 == "te":
        settings = [(label, o, b, "te" if f == "torchao" else f) for label, o, b, f in settings]

    out = claim_output_dir(args.out_dir, [], flag="--out-dir", tool="bench_train_gpu", continues=True,
                           owned=either(marked_by("bench_train_gpu"),
                                        holds_only(".csv", ".png", ".json", ".jsonl", ".log", ".txt")))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; preset {args.preset}; "
          f"{args.tokens_per_step} processed tokens per step", file=sys.stderr)

    attn = []
    for L in args.seq_lengths:
        batch = args.attention_batch or max(1, args.tokens_per_step // (2 * L))
        for r in bench_attention(L, batch, device=device, warmup=args.warmup, iters=2 * args.iters):
            attn.append(r)
            tqdm.write(f"attention L={L:<5d} {r.backend:16s} " + (f"error: {r.error}" if r.error else
                       f"{r.fwd_bwd_ms:8.2f} ms fwd+bwd  {r.ratio_vs_two_causal:5.2f}x two causal calls"),
                       file=sys.stderr)
        _write_csv(out / "bench_attention.csv", attn)

    rows = []
    jobs = [(s, L) for L in args.seq_lengths for s in settings]
    for (label, obj, backend, fp8), L in tqdm(jobs, desc="train-step settings", file=sys.stderr):
        r = bench_train_step(label, obj, backend, fp8, L, preset=args.preset, tokens_per_step=args.tokens_per_step,
                             warmup=args.warmup, iters=args.iters, device=device)
        rows.append(r)
        msg = (f"error: {r.error}" if r.error else
               f"{r.step_s * 1e3:8.1f} ms/step  {r.processed_tok_s:10.0f} proc tok/s  {r.sample_tok_s:10.0f} "
               f"sample tok/s  {r.model_tflops:7.1f} TFLOP/s  MFU {100 * r.mfu:5.1f}% "
               f"(no-attn {100 * r.mfu_dense_only:5.1f}%)  loss {r.loss:.3f}")
        tqdm.write(f"L={L:<5d} {label:26s} B={r.batch:<3d} {msg}", file=sys.stderr)
        _write_csv(out / "bench_train.csv", rows)          # after every setting: a timeout keeps what ran

    plot_mfu(rows, out / "mfu.png")
    ok = [r for r in rows if not r.error and r.objective == SETDLM.name]
    best = max(ok, key=lambda r: r.processed_tok_s, default=None)
    summary = {"device": name, "torch": torch.__version__, "preset": args.preset,
               "tokens_per_step": args.tokens_per_step,
               "fastest_setdlm": None if best is None else dataclasses.asdict(best),
               **{f"{n}_vs_two_causal": {str(r.L): r.ratio_vs_two_causal for r in attn
                                            if r.backend == n and not r.error} for n in kernel_backends()},
               "errors": {f"{r.label}@{r.L}": r.error for r in rows if r.error}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))
    print(f"wrote {out}/bench_train.csv, bench_attention.csv, summary.json, mfu.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
