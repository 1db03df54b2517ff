#!/usr/bin/env python
"""Data-parallel step time with overlapped vs plain gradient reduction (megatron-core DDP), PP = 1 and 2.

    python tools/bench_grad_reduce.py                      # 4 layers, h = 256, L = 128, 8 steps, CPU gloo
    python tools/bench_grad_reduce.py --json out.json model.hidden_size=512

Trains on the embedded corpus (generated into a temporary directory) on 2 and 4 local gloo ranks; prints
the median step time of each variant and the ratio plain / overlapped measured in the same run
(benchmarks/grad_reduce.py).
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import _checkout  # noqa: F401  (benchmarks/ is not installed)

from benchmarks.grad_reduce import run
from setdiff_mega.cli import run_cli
from setdiff_mega.data.prepare import prepare
from setdiff_mega.outputs import check_output_file, write_file_atomic

DEFAULT = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "data.seq_length=128",
           "train.micro_batch_size=4", "train.grad_accum_steps=4", "objective.name=setdlm"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--bucket-size", type=int, default=200_000, help="elements per bucket when overlapping")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    p.add_argument("overrides", nargs="*", help="dotted config overrides on top of the benchmark's model")
    args = p.parse_args(argv)
    if args.json:
        check_output_file(args.json, [], flag="--json", overwrite=args.overwrite)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        prepare(d, None, num_math=300, num_stories=300, vocab_size=400, heldout=10, log=lambda *a: None)
        rows = run(d, d, [*DEFAULT, *args.overrides], steps=args.steps, bucket_size=args.bucket_size)
    if args.json:
        write_file_atomic(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
