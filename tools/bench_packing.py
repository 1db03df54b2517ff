#!/usr/bin/env python
"""Packing benchmark (not a test): padded vs packed supervised samples on a GSM8K-like length distribution
(prompts ~100, answers ~200 tokens), L = 1024, the same model and objective, measured in the same run.

    python tools/bench_packing.py                                  # SetDLM D = 4, sdpa, 2 x 5 timed steps
    python tools/bench_packing.py --json runs/bench_packing.json model.attention_backend=setcausal

Prints, per layout, the fill (non-padding fraction of the samples' positions), answer tokens per sample and
the training throughput in answer (target) tokens/s, and the packed / padded ratio
(benchmarks/packing.py).
"""
import argparse
import json
import sys

import _checkout  # noqa: F401  (benchmarks/ is not installed)

from benchmarks.packing import run
from setdiff_mega.cli import run_cli
from setdiff_mega.config import load_config
from setdiff_mega.outputs import check_output_file, write_file_atomic
from setdiff_mega.parallel import initialize

DEFAULT = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4", "objective.name=setdlm",
           "objective.D=4"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-length", type=int, default=1024, help="L")
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="training steps per layout (the first is not timed)")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    p.add_argument("overrides", nargs="*", help="dotted config overrides (model.*, objective.*)")
    args = p.parse_args(argv)
    if args.json:
        check_output_file(args.json, [], flag="--json", overwrite=args.overwrite)
    cfg = load_config(None, [*DEFAULT, f"data.seq_length={args.seq_length}", *args.overrides])
    initialize(seed=1234, backend="gloo")
    res = run(cfg.model, cfg.objective.name, cfg.objective.options, args.seq_length, args.conversations,
              args.micro_batch, args.steps)
    for name in ("padded", "packed"):
        r = res[name]
        print(f"{name:7s} fill {r['fill']:.3f}  {r['targets_per_sample']:6.1f} answer tokens/sample  "
              f"{r['target_tokens_per_s']:8.1f} answer tok/s  {r['sample_tokens_per_s']:8.1f} sample tok/s")
    print(f"packed / padded answer tokens/s: {res['packed_over_padded_target_tokens_per_s']:.2f}x "
          f"({res['mean_conversations_per_packed_sample']:.2f} conversations per packed sample)")
    if args.json:
        write_file_atomic(args.json, json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
