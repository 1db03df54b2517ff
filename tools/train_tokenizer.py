#!/usr/bin/env python
"""Train a byte-level BPE tokenizer, or adopt an existing tokenizer.json, for setdiff-mega.

    python tools/train_tokenizer.py --input corpus.jsonl more/*.txt --json-keys text --vocab-size 8192 --out tok/
    python tools/train_tokenizer.py --from-tokenizer gpt2/tokenizer.json --bos "<|endoftext|>" \\
        --eos "<|endoftext|>" --out tok/          # adds <|mask|> when missing and records the ids

Inputs: JSONL, parquet, plain text (blank-line separated documents) and datasets.save_to_disk
directories, several files or globs. Writes OUT/tokenizer.json (+ tokenizer.special_tokens.json for
adopted tokenizers) and prints the special ids. An existing OUT/tokenizer.json is replaced only with
--overwrite, and never when it is the tokenizer being adopted.
"""
import argparse
import json
import sys
from itertools import islice
from pathlib import Path

from setdiff_mega.cli import run_cli
from setdiff_mega.data.preprocess import expand_inputs, plan_units, read_unit
from setdiff_mega.data.tokenizer import Tokenizer, roles_path
from setdiff_mega.outputs import check_output_file


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="training corpus files / globs / datasets directories")
    src.add_argument("--from-tokenizer", help="an existing tokenizer.json to adopt")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--max-documents", type=int, default=None, help="train on the first N documents only")
    p.add_argument("--bos", default=None)
    p.add_argument("--eos", default=None)
    p.add_argument("--pad", default=None)
    p.add_argument("--mask", default="<|mask|>")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT/tokenizer.json")
    args = p.parse_args(argv)

    out = Path(args.out)
    inputs = [*(args.input or []), args.from_tokenizer,
              args.from_tokenizer and roles_path(args.from_tokenizer)]
    for f in (out / "tokenizer.json", roles_path(out / "tokenizer.json")):
        check_output_file(f, inputs, flag="--out", overwrite=args.overwrite)
    if args.from_tokenizer:
        if not args.bos or not args.eos:
            raise ValueError("--from-tokenizer needs --bos and --eos (the token strings of those roles)")
        tok = Tokenizer.adopt(args.from_tokenizer, bos=args.bos, eos=args.eos, pad=args.pad, mask=args.mask)
    else:
        units = plan_units(expand_inputs(args.input))
        docs = (d for u in units for d in read_unit(u, args.json_keys))
        tok = Tokenizer.train(islice(docs, args.max_documents), vocab_size=args.vocab_size,
                              min_frequency=args.min_frequency)
    tok.save(out / "tokenizer.json")
    print(json.dumps({"tokenizer": str(out / "tokenizer.json"), "vocab_size": tok.vocab_size,
                      "special_ids": tok.special_ids, "hash": tok.hash}))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
