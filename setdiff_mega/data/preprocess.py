"""Corpus preprocessing at scale: many inputs -> parallel batched tokenization -> one indexed dataset.

Inputs (any mix, globs allowed): JSONL (``json_keys`` fields, concatenated with a newline when several),
parquet (same keys as columns), plain text (one document per blank-line-separated block) and
``datasets.save_to_disk`` directories. Each input is cut into **work units** (JSONL: newline-aligned
byte ranges of ``unit_bytes``; parquet: row groups; datasets: contiguous index ranges; text: whole
files). A pool of ``workers`` processes takes units; each worker reads its unit, tokenizes it (the
exact word-cached fast path of :mod:`.fast_encode` for byte-level BPE, else the tokenizer's batched
``encode_batch``) and writes its own ``.bin/.idx`` shard with megatron-core's
``IndexedDatasetBuilder``; no token lists travel back through a pipe. The parent merges the shards in
input order (``IndexedDatasetBuilder.add_index``), so the document order equals the input order for
any number of workers, then writes the manifest.

Per document: ``[BOS]? tokens [EOD]?`` (``append_eod`` default on, ``prepend_bos`` default on), one
sequence per document, or one per sentence when the value is a list of sentences; an empty document is
written as an empty document (no tokens, no sequence), as Megatron-LM's ``preprocess_data.py`` writes it,
so with ``--no-bos`` the output is byte-identical to Megatron's on any corpus. Record rules and error
messages (null / numbers refused, UTF-8, line numbers in the file): :mod:`.records`.
Everything is written under ``<prefix>.tmp-<owner tag>-<n>/`` and renamed into place; the manifest is written last,
so an interrupted run never leaves a dataset that looks complete.
"""
from __future__ import annotations

import gc
import glob
import itertools
import json
import os
import shutil
import time
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tqdm import tqdm

from setdiff_mega.staging import owner_tag, record_owner, sweep_leftovers

from .fast_encode import FastEncoder
from .indexed import (
    MANIFEST_FORMAT,
    DataError,
    check_dataset,
    check_output_prefix,
    manifest_path,
    read_manifest,
    sha256_file,
    token_dtype,
    write_manifest,
)
from .reader import read_records, read_unit
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class WorkUnit:
    index: int
    path: str
    kind: str            # jsonl | parquet | text | hfdisk
    start: int           # byte offset / row group / first row
    stop: int            # exclusive
    nbytes: int


def detect_kind(path: str) -> str:
    p = Path(path)
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
            return "hfdisk"
        raise DataError(f"input directory '{p}' is not a datasets.save_to_disk directory (no dataset_info.json)")
    if p.suffix in (".gz", ".zst", ".bz2", ".xz"):
        raise DataError(f"input '{p}' is compressed; decompress it first (e.g. gunzip -k '{p}')")
    if p.suffix in (".jsonl", ".json"):
        return "jsonl"
    if p.suffix == ".parquet":
        return "parquet"
    return "text"


def expand_inputs(inputs: list[str]) -> list[str]:
    paths: list[str] = []
    for item in inputs:
        hits = sorted(glob.glob(item)) if any(c in item for c in "*?[") else [item]
        if not hits:
            raise DataError(f"input pattern '{item}' matches no file")
        for h in hits:
            if not os.path.exists(h):
                raise DataError(f"input '{h}' does not exist")
            paths.append(h)
    return paths


def plan_units(paths: list[str], unit_bytes: int = 8 << 20, unit_rows: int = 20000) -> list[WorkUnit]:
    """Cut inputs into independent work units (in input order)."""
    units: list[WorkUnit] = []
    for path in paths:
        kind = detect_kind(path)
        if kind == "jsonl":
            size = os.path.getsize(path)
            if size == 0:
                continue
            cuts = [0]
            with open(path, "rb") as f:
                while cuts[-1] + unit_bytes < size:
                    f.seek(cuts[-1] + unit_bytes)
                    f.readline()                               # align to the next line start
                    pos = f.tell()
                    if pos >= size:
                        break
                    cuts.append(pos)
            cuts.append(size)
            for a, b in zip(cuts, cuts[1:]):
                units.append(WorkUnit(len(units), path, kind, a, b, b - a))
        elif kind == "parquet":
            import pyarrow.parquet as pq  # gated: parquet inputs only (pyarrow costs a second of start-up)

            pf = pq.ParquetFile(path)
            for g in range(pf.num_row_groups):
                units.append(WorkUnit(len(units), path, kind, g, g + 1, pf.metadata.row_group(g).total_byte_size))
        elif kind == "hfdisk":
            from datasets import load_from_disk  # gated: datasets directories only (slow to import)

            ds = load_from_disk(path)
            if hasattr(ds, "keys"):
                raise DataError(f"'{path}' is a DatasetDict ({', '.join(ds.keys())}); point at one split directory")
            for a in range(0, len(ds), unit_rows):
                b = min(a + unit_rows, len(ds))
                units.append(WorkUnit(len(units), path, kind, a, b, 0))
        else:
            units.append(WorkUnit(len(units), path, kind, 0, os.path.getsize(path), os.path.getsize(path)))
    return units


_WORKER: dict = {}


def _init_worker(tokenizer_path: str, threads: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    os.environ["RAYON_NUM_THREADS"] = str(max(1, threads))
    _WORKER["tok"] = Tokenizer.from_file(tokenizer_path)
    _WORKER["enc"] = FastEncoder(_WORKER["tok"])


def encode_unit(args) -> dict:
    """Worker: tokenize one unit in batches and write its shard; returns counts."""
    unit, keys, shard_prefix, batch, prepend_bos, append_eod = args

    tok, enc = _WORKER["tok"], _WORKER["enc"]
    dtype = token_dtype(tok.vocab_size)
    builder = IndexedDatasetBuilder(f"{shard_prefix}.bin", dtype=dtype)
    docs = toks = 0
    buf: list[str] = []
    head = [tok.bos] if prepend_bos else []
    tail = [tok.eos] if append_eod else []

    def flush():
        nonlocal docs, toks
        flat = [t for d in buf for t in ([d] if isinstance(d, str) else d)]
        ids_all, i = enc.encode_batch(flat), 0
        for d in buf:
            n = 1 if isinstance(d, str) else len(d)
            sentences = [ids for ids in ids_all[i:i + n] if ids]
            i += n
            lengths = [len(ids) for ids in sentences]
            if lengths:                  # BOS / EOD belong to the first / last sentence (Megatron: EOD only)
                lengths[0] += len(head)
                lengths[-1] += len(tail)
            # an empty document stays empty (no BOS, no EOD), as Megatron-LM's preprocess_data.py writes it
            arr = np.asarray(head + [t for ids in sentences for t in ids] + tail if lengths else [], dtype=dtype)
            builder.add_document(arr, lengths)
            docs += 1
            toks += arr.size
        buf.clear()

    for text in read_unit(unit, keys):
        buf.append(text)
        if len(buf) >= batch:
            flush()
    if buf:
        flush()
    builder.finalize(f"{shard_prefix}.idx")
    return {"unit": unit.index, "docs": docs, "tokens": toks, "bytes": unit.nbytes}


def _shard_units(units: list, shard, paths, unit_bytes: int) -> list:
    if shard is None:
        return units
    i, n = shard
    if not (n >= 1 and 0 <= i < n):
        raise DataError(f"shard {i}/{n} is invalid: use i/n with 0 <= i < n")
    units = units[len(units) * i // n: len(units) * (i + 1) // n]
    if not units:
        raise DataError(f"shard {i}/{n} has no work units ({len(plan_units(paths, unit_bytes))} in total); "
                        f"use fewer shards or a smaller --unit-mb")
    return units


def _staging(out: Path) -> Path:
    """A fresh ``<out>.tmp-<owner tag>-<n>`` directory of this invocation, naming its owner; leftovers of earlier runs
    are removed only when their owner is provably dead (:mod:`setdiff_mega.staging`), else reported."""
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(out.parent, (f"{out.name}.tmp-",))
    for n in itertools.count():
        tmp = out.parent / f"{out.name}.tmp-{owner_tag()}-{n}"
        try:
            tmp.mkdir()
            record_owner(tmp)
            return tmp
        except FileExistsError:
            continue


def _encode_all(jobs: list, tokenizer_path: str, workers: int, total_bytes: int, progress: bool,
                work=None, init=None, init_args: tuple = ()) -> tuple:
    """Run ``work`` (:func:`encode_unit`) over ``jobs`` (in a fork pool when workers > 1), each worker set up by
    ``init(*init_args, threads)`` (:func:`_init_worker(tokenizer_path, threads)`); -> (documents, tokens)."""
    work, init = work or encode_unit, init or _init_worker
    init_args = init_args or (tokenizer_path,)
    t0 = time.perf_counter()
    docs = toks = done_bytes = 0
    bar = tqdm(total=total_bytes or len(jobs), unit="B", unit_scale=True, desc="tokenize", disable=not progress)
    pool = None
    try:
        if workers <= 1:
            init(*init_args, max(1, os.cpu_count() or 1))
            results = map(work, jobs)
        else:
            # imported once here, before the fork, instead of once per worker (seconds each at start-up)
            pool = get_context("fork").Pool(workers, initializer=init, initargs=(*init_args, 1))
            results = pool.imap_unordered(work, jobs)
        for r in results:
            docs, toks, done_bytes = docs + r["docs"], toks + r["tokens"], done_bytes + r["bytes"]
            bar.update(r["bytes"] if total_bytes else 1)
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix({"docs/s": f"{docs / dt:,.0f}", "MB/s": f"{done_bytes / dt / 1e6:.1f}"}, refresh=False)
        if pool is not None:
            pool.close()
            pool.join()
    finally:
        bar.close()
        if pool is not None:      # stop workers still writing shards before the temp dir goes away
            pool.terminate()
            pool.join()
    return docs, toks


def _merge_shards(tmp: Path, units: list, dtype, out: Path, name: str = "shard", manifest: bool = True) -> None:
    """The worker shards ``<name>NNNNNN``, in unit order, -> ``<out>.bin/.idx`` (renamed into place; the old
    manifest goes first, ``manifest=False``: ``out`` has none of its own, e.g. a supervised target mask)."""
    builder = IndexedDatasetBuilder(str(tmp / f"{name}-merged.bin"), dtype=dtype)
    gc.freeze()          # add_index runs gc.collect() per shard; frozen objects make that cheap
    try:
        for u in units:
            builder.add_index(str(tmp / f"{name}{u.index:06d}"))
    finally:
        gc.unfreeze()
    builder.finalize(str(tmp / f"{name}-merged.idx"))
    if manifest:
        manifest_path(out).unlink(missing_ok=True)
    os.replace(tmp / f"{name}-merged.bin", f"{out}.bin")
    os.replace(tmp / f"{name}-merged.idx", f"{out}.idx")


def preprocess(inputs: list[str], output_prefix: str, tokenizer_path: str, *, json_keys=("text",),
               workers: int = 2, batch_size: int = 256, unit_bytes: int = 2 << 20, prepend_bos: bool = True,
               append_eod: bool = True, progress: bool = True, shard: tuple[int, int] | None = None,
               log=print, overwrite: bool = False) -> dict:
    """Tokenize ``inputs`` into ``output_prefix.{bin,idx}`` + manifest; returns the manifest. An existing
    dataset at ``output_prefix`` is refused unless ``overwrite`` (and even then one this project did not
    write, or an input, is never replaced: :func:`.indexed.check_output_prefix`).

    ``shard=(i, n)`` processes only the i-th of n contiguous slices of the work units (for several
    machines); :func:`merge` then joins the n outputs in order into the same dataset one run would give.
    """
    tok = Tokenizer.from_file(tokenizer_path)
    paths = expand_inputs(list(inputs))
    check_output_prefix(output_prefix, [*paths, tokenizer_path], overwrite)
    units = plan_units(paths, unit_bytes)
    if not units:
        raise DataError(f"the inputs {paths} hold no data (empty files)")
    units = _shard_units(units, shard, paths, unit_bytes)
    out = Path(output_prefix)
    tmp = _staging(out)
    keys = list(json_keys)
    jobs = [(u, keys, str(tmp / f"shard{u.index:06d}"), batch_size, prepend_bos, append_eod) for u in units]
    total_bytes = sum(u.nbytes for u in units)
    t0 = time.perf_counter()
    try:
        docs, toks = _encode_all(jobs, tokenizer_path, workers, total_bytes, progress)
        if toks == 0:
            raise DataError(f"the inputs {paths} hold no non-empty documents")
        _merge_shards(tmp, units, token_dtype(tok.vocab_size), out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    tokens = np.memmap(f"{out}.bin", dtype=token_dtype(tok.vocab_size), mode="r")
    manifest = {
        "format": MANIFEST_FORMAT, "num_documents": docs, "num_tokens": toks,
        "max_token_id": int(tokens.max()) if tokens.size else -1, "dtype": np.dtype(token_dtype(tok.vocab_size)).name,
        "tokenizer": {"hash": tok.hash, "vocab_size": tok.vocab_size, "special_ids": tok.special_ids,
                      "path": str(tokenizer_path)},
        "inputs": paths, "shard": list(shard) if shard else None, "json_keys": keys, "prepend_bos": prepend_bos,
        "append_eod": append_eod,
        "sha256": {"bin": sha256_file(Path(f"{out}.bin")), "idx": sha256_file(Path(f"{out}.idx"))},
        "seconds": round(elapsed, 3), "docs_per_s": round(docs / max(elapsed, 1e-9), 1),
        "mb_per_s": round(total_bytes / max(elapsed, 1e-9) / 1e6, 3),
    }
    del tokens
    write_manifest(out, manifest)
    log(f"wrote {docs} documents, {toks} tokens to {out}.bin/.idx in {elapsed:.1f}s "
        f"({manifest['docs_per_s']:,.0f} docs/s, {manifest['mb_per_s']:.1f} MB/s, {workers} workers)")
    return manifest


def merge(prefixes: list[str], output_prefix: str, log=print, overwrite: bool = False) -> dict:
    """Join datasets (e.g. the shards of one preprocessing run) in order into ``output_prefix`` (the same
    output rules as :func:`preprocess`; the output is never one of the inputs)."""
    if not prefixes:
        raise DataError("nothing to merge: pass the dataset prefixes to join")
    check_output_prefix(output_prefix, [f"{p}{ext}" for p in prefixes for ext in (".bin", ".idx", ".manifest.json")],
                        overwrite)
    infos = [check_dataset(p, verify_hashes=True) for p in prefixes]
    manifests = [read_manifest(p) for p in prefixes]
    sft = [p for p, m in zip(prefixes, manifests) if (m or {}).get("kind") == "sft"]
    if sft:
        raise DataError(f"'{sft[0]}' is supervised data (tokens and a target mask), which --merge does not join; "
                        f"preprocess all the inputs into one dataset (--sft --input a.jsonl b.jsonl ...)")
    toks = {json.dumps((m or {}).get("tokenizer", {}).get("hash")) for m in manifests}
    if len(toks) > 1:
        raise DataError(f"cannot merge datasets made with different tokenizers ({', '.join(sorted(toks))})")
    dtypes = {np.dtype(IndexedDataset(p).index.dtype).name for p in prefixes}
    if len(dtypes) > 1:
        raise DataError(f"cannot merge datasets with different token dtypes ({', '.join(sorted(dtypes))})")
    out = Path(output_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=np.dtype(dtypes.pop()).type)
    gc.freeze()
    try:
        for p in prefixes:
            builder.add_index(str(p))
        builder.finalize(f"{tmp}.idx")
    finally:
        gc.unfreeze()
    manifest_path(out).unlink(missing_ok=True)
    os.replace(f"{tmp}.bin", f"{out}.bin")
    os.replace(f"{tmp}.idx", f"{out}.idx")
    base = manifests[0] or {}
    manifest = {"format": MANIFEST_FORMAT, "num_documents": sum(i["num_documents"] for i in infos),
                "num_tokens": sum(i["num_tokens"] for i in infos),
                "max_token_id": max(i["max_token_id"] for i in infos), "dtype": base.get("dtype"),
                "tokenizer": base.get("tokenizer"), "merged_from": [str(p) for p in prefixes],
                "sha256": {"bin": sha256_file(Path(f"{out}.bin")), "idx": sha256_file(Path(f"{out}.idx"))}}
    write_manifest(out, manifest)
    log(f"merged {len(prefixes)} datasets: {manifest['num_documents']} documents, {manifest['num_tokens']} tokens "
        f"-> {out}.bin/.idx")
    return manifest


__all__ = ["preprocess", "merge", "plan_units", "read_unit", "read_records", "expand_inputs", "detect_kind",
           "WorkUnit"]
