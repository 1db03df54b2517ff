#!/usr/bin/env python
"""Tokenize corpora into a Megatron-format indexed dataset (.bin/.idx) plus a JSON manifest.

    python tools/preprocess_data.py --input data/raw/*.jsonl --json-keys text --tokenizer tok/tokenizer.json \\
        --output-prefix data/mine/corpus --workers 2
    # across machines: slice i of n of the same inputs on each, then join in order
    python tools/preprocess_data.py --input ... --tokenizer ... --shard 0/2 --output-prefix data/part0/corpus
    python tools/preprocess_data.py --merge data/part0/corpus data/part1/corpus --output-prefix data/mine/corpus

Inputs: JSONL (--json-keys; several keys are joined by a newline), parquet (same keys as columns), plain
text (blank-line separated documents) and datasets.save_to_disk directories; several files or globs.
Each document becomes [BOS] tokens [EOD] (--no-bos / --no-eod to drop them); uint16 when the vocabulary
fits. Workers tokenize independent work units in batches and write shards that are merged in input
order. The manifest (counts, tokenizer hash and ids, SHA-256 of .bin and .idx) is written last: an
interrupted run never leaves a dataset that looks complete. An existing dataset at --output-prefix is
refused unless --overwrite, and one without this project's manifest (or an input) is never replaced.
"""
import argparse
import sys

from setdiff_mega.cli import run_cli
from setdiff_mega.data.preprocess import merge, preprocess


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", help="files, globs or datasets directories to tokenize")
    p.add_argument("--merge", nargs="+", metavar="PREFIX", help="instead: join these datasets in order")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="process only slice I of N of the work units (several machines), then --merge")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer", help="tokenizer.json (tools/train_tokenizer.py)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256, help="documents per encode_batch call")
    p.add_argument("--unit-mb", type=float, default=2.0, help="JSONL work-unit size in MB")
    p.add_argument("--no-bos", action="store_true")
    p.add_argument("--no-eod", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset this tool wrote at --output-prefix (never one without a manifest, never "
                        "an input)")
    args = p.parse_args(argv)

    if args.merge:
        merge(args.merge, args.output_prefix, overwrite=args.overwrite)
        return 0
    if not args.input or not args.tokenizer:
        raise ValueError("pass --input and --tokenizer (or --merge PREFIX ...)")
    shard = None
    if args.shard:
        try:
            i, n = (int(x) for x in args.shard.split("/"))
        except ValueError:
            raise ValueError(f"--shard {args.shard!r} must look like I/N, e.g. 0/4") from None
        shard = (i, n)
    preprocess(args.input, args.output_prefix, args.tokenizer, json_keys=args.json_keys, workers=args.workers,
               batch_size=args.batch_size, unit_bytes=int(args.unit_mb * (1 << 20)), prepend_bos=not args.no_bos,
               append_eod=not args.no_eod, progress=not args.no_progress, shard=shard, overwrite=args.overwrite)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
