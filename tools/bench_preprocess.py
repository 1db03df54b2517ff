#!/usr/bin/env python
"""Preprocessing benchmark (not a test): ours vs a re-implementation of Megatron-LM's per-document pipeline.

The baseline (a) is written here after Megatron-LM's tools/preprocess_data.py; it is not that script
(which no installed package ships), so the ratio is a proxy. The measured comparison with the real
script (byte-identical output with --no-bos, 1.9x at 2 workers) is in docs/results.md.

    python tools/bench_preprocess.py [--docs 60000] [--workers 2] [--out-dir runs/bench_preprocess]

In one run, on the same JSONL corpus (the embedded generator, written once), the same tokenizer and the
same worker count, it times
  (a) the approach of Megatron-LM's tools/preprocess_data.py, re-implemented here: the parent reads lines,
      multiprocessing.Pool.imap sends each line to a worker that parses the JSON and calls
      tokenizer.encode once per document, the token lists come back through the pool and the parent
      writes them with megatron-core's IndexedDatasetBuilder;
  (b) setdiff_mega's preprocess: newline-aligned work units, batched encode_batch in the workers, each
      worker writing its own shard, ordered merge.
It checks that both produce the same tokens, prints docs/s, MB/s and the ratio, and writes a CSV.
"""
import argparse
import csv
import json
import os
import sys
import time
from multiprocessing import get_context

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tokenizers import Tokenizer as HFTokenizer

from setdiff_mega.cli import run_cli
from setdiff_mega.data.corpus import embedded_corpus, write_jsonl
from setdiff_mega.data.preprocess import preprocess
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.outputs import claim_output_dir, either, holds_only, marked_by

_TOK = {}


def _init(path):
    _TOK["t"] = HFTokenizer.from_file(path)
    _TOK["bos"], _TOK["eos"] = _TOK["t"].token_to_id("<|bos|>"), _TOK["t"].token_to_id("<|eos|>")


def _encode_line(line):
    """Megatron-LM's Encoder.encode: one json.loads and one encode per document."""
    text = json.loads(line)["text"]
    ids = _TOK["t"].encode(text, add_special_tokens=False).ids
    return [_TOK["bos"]] + ids + [_TOK["eos"]], len(line)


def standard(jsonl, tokenizer, prefix, workers):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    t0 = time.perf_counter()
    with open(jsonl, encoding="utf-8") as fin, get_context("fork").Pool(workers, initializer=_init,
                                                                        initargs=(tokenizer,)) as pool:
        docs = 0
        for ids, _ in pool.imap(_encode_line, fin, 32):
            builder.add_document(np.asarray(ids, dtype=np.uint16), [len(ids)])
            docs += 1
    builder.finalize(prefix + ".idx")
    return docs, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=60000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="best of N timings per method")
    p.add_argument("--out-dir", default="runs/bench_preprocess")
    args = p.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    out = claim_output_dir(args.out_dir, [], flag="--out-dir", tool="bench_preprocess", continues=True,
                           owned=either(marked_by("bench_preprocess"), holds_only(
                               ".csv", ".png", ".json", ".jsonl", ".log", ".txt", ".bin", ".idx")))
    before = set(out.iterdir())                 # the cleanup below removes only what this run wrote
    jsonl = out / "corpus.jsonl"
    docs = embedded_corpus(args.docs // 2, args.docs - args.docs // 2, seed=123)
    write_jsonl([{"text": d["text"]} for d in docs], jsonl)
    tok = Tokenizer.train((d["text"] for d in docs[:5000]), vocab_size=2048)
    tok.save(out / "tokenizer.json")
    mb = jsonl.stat().st_size / 1e6
    rows = []
    best = {}
    for method in ("standard", "setdiff_mega"):
        times = []
        for r in range(args.repeats):
            prefix = str(out / f"{method}_{r}")
            if method == "standard":
                n, dt = standard(str(jsonl), str(out / "tokenizer.json"), prefix, args.workers)
            else:
                t0 = time.perf_counter()
                m = preprocess([str(jsonl)], prefix, str(out / "tokenizer.json"), workers=args.workers,
                               progress=False, log=lambda *a: None)
                n, dt = m["num_documents"], time.perf_counter() - t0
            times.append(dt)
        dt = min(times)
        best[method] = dt
        rows.append({"method": method, "workers": args.workers, "documents": n, "megabytes": round(mb, 2),
                     "seconds": round(dt, 3), "docs_per_s": round(n / dt, 1), "mb_per_s": round(mb / dt, 3)})
        print(f"{method:13s} {n} docs in {dt:.2f}s: {n / dt:,.0f} docs/s, {mb / dt:.2f} MB/s", flush=True)
    a, b = IndexedDataset(str(out / "standard_0")), IndexedDataset(str(out / "setdiff_mega_0"))
    same = len(a) == len(b) and all(np.array_equal(a[i], b[i]) for i in range(0, len(a), max(1, len(a) // 500)))
    ratio = best["standard"] / best["setdiff_mega"]
    print(f"ratio (ours / standard docs/s): {ratio:.2f}x; identical tokens: {same}")
    with open(out / "bench_preprocess.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["ratio_vs_standard", "identical_tokens"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "ratio_vs_standard": round(best["standard"] / r["seconds"], 3), "identical_tokens": same})
    for r in range(args.repeats):               # the timed datasets this run wrote (not the CSV, corpus, tokenizer)
        for method in ("standard", "setdiff_mega"):
            for f in out.glob(f"{method}_{r}.*"):
                if f not in before:
                    f.unlink()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
