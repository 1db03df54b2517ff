#!/usr/bin/env python
"""Tokenize corpora into a Megatron-format indexed dataset (.bin/.idx) plus a JSON manifest.

    python tools/preprocess_data.py --input data/raw/*.jsonl --json-keys text --tokenizer tok/tokenizer.json \\
        --output-prefix data/mine/corpus --workers 2
    # across machines: slice i of n of the same inputs on each, then join in order
    python tools/preprocess_data.py --input ... --tokenizer ... --shard 0/2 --output-prefix data/part0/corpus
    python tools/preprocess_data.py --merge data/part0/corpus data/part1/corpus --output-prefix data/mine/corpus
    # supervised conversations ({"prompt", "response"} or {"messages": [...]}) with the tokenizer's chat template
    python tools/preprocess_data.py --sft --input chats.jsonl --tokenizer run/tokenizer.json \
        --output-prefix data/chat/corpus --chat-template-kwargs '{"enable_thinking": false}'

Inputs: JSONL (--json-keys; several keys are joined by a newline), parquet (same keys as columns), plain
text (blank-line separated documents) and datasets.save_to_disk directories; several files or globs.
Each document becomes [BOS] tokens [EOD] (--no-bos / --no-eod to drop them); uint16 when the vocabulary
fits. Workers tokenize independent work units in batches and write shards that are merged in input
order. The manifest (counts, tokenizer hash and ids, SHA-256 of .bin and .idx) is written last: an
interrupted run never leaves a dataset that looks complete. An existing dataset at --output-prefix is
refused unless --overwrite, and one without this project's manifest (or an input) is never replaced.

--sft: supervised records rendered with the chat template (the tokenizer's, or --chat-template FILE; "none":
plain prompt + response), a companion <prefix>.target.bin/.idx marking the target tokens (every assistant
turn, or --loss-on last); see setdiff_mega/data/sft.py.
"""
import argparse
import json
import sys

from setdiff_mega.cli import run_cli
from setdiff_mega.data.preprocess import merge, preprocess
from setdiff_mega.data.sft import preprocess_sft


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
    p.add_argument("--sft", action="store_true", help="supervised records (prompt / response or messages)")
    p.add_argument("--chat-template", default=None, help="--sft: a Jinja template file (default: the tokenizer's; "
                   "none: plain prompt + response)")
    p.add_argument("--chat-template-kwargs", default="{}", help="--sft: JSON keyword arguments of the template, e.g. "
                   "'{\"enable_thinking\": false}'")
    p.add_argument("--loss-on", choices=("all", "last"), default="all", help="--sft: which assistant turns are targets")
    args = p.parse_args(argv)

    if args.sft:
        if not args.input or not args.tokenizer:
            raise ValueError("--sft needs --input and --tokenizer")
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--chat-template-kwargs is not a JSON object ({e.msg})") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
        preprocess_sft(args.input, args.output_prefix, args.tokenizer, chat_template=args.chat_template,
                       template_kwargs=kwargs, loss_on=args.loss_on, workers=args.workers,
                       unit_bytes=int(args.unit_mb * (1 << 20)), progress=not args.no_progress,
                       overwrite=args.overwrite)
        return 0
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
