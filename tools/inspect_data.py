#!/usr/bin/env python
"""Inspect and verify an indexed dataset: manifest, token statistics, the first documents decoded.

    python tools/inspect_data.py data/embedded/corpus [--tokenizer tok.json] [--docs 3] [--no-verify]

Verifies the .bin size against the index pointers and, when a manifest exists, the SHA-256 of both
files; exits 2 with a message naming the file and the problem when anything is off.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

from setdiff_mega.cli import run_cli
from setdiff_mega.data.indexed import check_dataset
from setdiff_mega.data.tokenizer import Tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", help="dataset prefix (without .bin/.idx)")
    p.add_argument("--tokenizer", default=None, help="default: tokenizer.json next to the data")
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check")
    args = p.parse_args(argv)


    tok_path = Path(args.tokenizer) if args.tokenizer else Path(args.prefix).parent / "tokenizer.json"
    tok = Tokenizer.from_file(tok_path) if tok_path.is_file() else None
    info = check_dataset(args.prefix, tok.vocab_size if tok else None, verify_hashes=not args.no_verify,
                         tokenizer=tok)
    ds = IndexedDataset(args.prefix)
    lengths = np.asarray(ds.index.sequence_lengths)
    stats = {"documents": info["num_documents"], "sequences": int(lengths.size), "tokens": int(lengths.sum()),
             "dtype": str(ds.index.dtype.__name__ if hasattr(ds.index.dtype, "__name__") else ds.index.dtype),
             "doc_tokens": {"min": int(lengths.min()), "mean": round(float(lengths.mean()), 2),
                            "median": float(np.median(lengths)), "max": int(lengths.max())},
             "max_token_id": info["max_token_id"], "hashes_verified": bool(info["manifest"]) and not args.no_verify}
    if info["manifest"]:
        print("manifest:", json.dumps(info["manifest"], indent=2))
    print("statistics:", json.dumps(stats, indent=2))
    if tok:
        for i in range(min(args.docs, len(ds))):
            print(f"--- document {i} ({len(ds[i])} tokens)")
            print(tok.decode(ds[i]))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
