"""Supervised (conversation) data, preprocessed once into Megatron-format datasets.

``preprocess_sft`` reads JSONL / parquet / ``datasets`` directories of prompt / response records or
``messages`` conversations (:mod:`.chat`), renders each with the chat template and writes, per
conversation, one document to two indexed datasets with the same document lengths:

    <prefix>.bin / .idx               the tokens (megatron-core's readers read them as pretraining data)
    <prefix>.target.bin / .idx        uint8 per token: 1 = a target token (an assistant turn, EOS), 0 = context

and the manifest (``kind: sft``: the tokenizer's hash, the template's hash and keyword arguments, the loss
rule, the counts, every file's sha256). The work runs as pretraining preprocessing does
(:mod:`.preprocess`: work units over a process pool, a shard pair per unit and per dataset, merged in input
order, a progress bar); everything is written under ``<prefix>.tmp-<owner tag>-<n>/`` and renamed into place, the
targets before the tokens and the manifest last, so an interrupted run never leaves a dataset that looks
complete. A bad record stops the run with one line naming ``file:line`` and the fix.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from setdiff_mega.outputs import OutputError, check_output_file

from .chat import ChatRenderer, template_hash
from .indexed import (
    MANIFEST_FORMAT,
    DataError,
    check_output_prefix,
    read_manifest,
    sha256_file,
    token_dtype,
    write_manifest,
)
from .preprocess import _encode_all, _merge_shards, _shard_units, _staging, expand_inputs, plan_units
from .reader import read_records
from .tokenizer import Tokenizer

TARGET_SUFFIX = ".target"                  # <prefix>.target.bin / .idx: the target mask
_WORKER: dict = {}


def target_prefix(prefix: str | Path) -> str:
    return f"{prefix}{TARGET_SUFFIX}"


def check_target_output(prefix, inputs) -> None:
    """``<prefix>.target.bin/.idx`` are replaced only as part of a supervised dataset this project wrote (the
    main prefix's rules, :func:`.indexed.check_output_prefix`, decide whether it may be replaced)."""
    files = [Path(f"{target_prefix(prefix)}{ext}") for ext in (".bin", ".idx")]
    for f in files:
        check_output_file(f, inputs, flag="--output-prefix", overwrite=True)
    existing = [f for f in files if f.exists()]
    if existing and (read_manifest(prefix) or {}).get("kind") != "sft":
        raise OutputError(f"--output-prefix '{prefix}': '{existing[0]}' exists and was not written by setdiff-mega's "
                          f"supervised preprocessing; it is never replaced: choose another --output-prefix")


def _init_worker(tokenizer_path: str, template: str | None, kwargs: dict, loss_on: str, threads: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"   # a forked worker: no rayon pool
    os.environ["RAYON_NUM_THREADS"] = str(max(1, threads))
    tok = Tokenizer.from_file(tokenizer_path)
    _WORKER["tok"] = tok
    _WORKER["render"] = ChatRenderer(tok, template, kwargs, loss_on)


def encode_unit(args) -> dict:
    """Worker: render and tokenize one unit's records into its token and target shards; returns counts."""
    unit, tmp = args
    tok, render = _WORKER["tok"], _WORKER["render"]
    shard = {kind: f"{tmp}/{kind}{unit.index:06d}" for kind in ("tok", "tgt")}     # what _merge_shards reads
    tokens = IndexedDatasetBuilder(f"{shard['tok']}.bin", dtype=token_dtype(tok.vocab_size))
    targets = IndexedDatasetBuilder(f"{shard['tgt']}.bin", dtype=np.uint8)
    docs = toks = tgts = 0
    for rec, where in read_records(unit):
        ids, mask = render.encode(rec, where)
        tokens.add_document(ids.astype(token_dtype(tok.vocab_size)), [ids.size])
        targets.add_document(mask, [mask.size])
        docs, toks, tgts = docs + 1, toks + ids.size, tgts + int(mask.sum())
    tokens.finalize(f"{shard['tok']}.idx")
    targets.finalize(f"{shard['tgt']}.idx")
    return {"unit": unit.index, "docs": docs, "tokens": toks, "targets": tgts, "bytes": unit.nbytes}


def read_template(tok: Tokenizer, chat_template: str | None) -> str | None:
    """The template text: ``chat_template`` (a file; ``"none"``: no template), else the tokenizer's."""
    if chat_template is None:
        return tok.chat_template
    if chat_template == "none":
        return None
    p = Path(chat_template)
    if not p.is_file():
        raise DataError(f"chat template file '{p}' does not exist (--chat-template)")
    return p.read_text()


def preprocess_sft(inputs: list[str], output_prefix: str, tokenizer_path: str, *, chat_template: str | None = None,
                   template_kwargs: dict | None = None, loss_on: str = "all", workers: int = 2,
                   unit_bytes: int = 2 << 20, progress: bool = True, log=print, overwrite: bool = False) -> dict:
    """Render and tokenize supervised ``inputs`` into ``output_prefix`` (see the module docstring); returns
    the manifest. The output rules are pretraining preprocessing's (:func:`.indexed.check_output_prefix`)."""
    tok = Tokenizer.from_file(tokenizer_path)
    template, kwargs = read_template(tok, chat_template), dict(template_kwargs or {})
    ChatRenderer(tok, template, kwargs, loss_on)                   # the options' errors before any work
    paths = expand_inputs(list(inputs))
    check_output_prefix(output_prefix, [*paths, tokenizer_path], overwrite)
    check_target_output(output_prefix, [*paths, tokenizer_path])
    units = _shard_units(plan_units(paths, unit_bytes), None, paths, unit_bytes)
    if not units:
        raise DataError(f"the inputs {paths} hold no data (empty files)")
    out = Path(output_prefix)
    tmp = _staging(out)
    jobs = [(u, str(tmp)) for u in units]
    t0 = time.perf_counter()
    try:
        counts = _encode_all(jobs, tokenizer_path, workers, sum(u.nbytes for u in units), progress,
                             work=encode_unit, init=_init_worker, init_args=(tokenizer_path, template, kwargs, loss_on))
        if counts[1] == 0:
            raise DataError(f"the inputs {paths} hold no supervised records")
        _merge_shards(tmp, units, np.uint8, Path(target_prefix(out)), name="tgt", manifest=False)
        _merge_shards(tmp, units, token_dtype(tok.vocab_size), out, name="tok")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _write_manifest(out, tok, tokenizer_path, paths, template, kwargs, loss_on, time.perf_counter() - t0, log)


def _write_manifest(out: Path, tok, tokenizer_path, paths, template, kwargs, loss_on, elapsed, log) -> dict:
    dtype = token_dtype(tok.vocab_size)
    tokens = np.memmap(f"{out}.bin", dtype=dtype, mode="r")
    targets = np.memmap(f"{target_prefix(out)}.bin", dtype=np.uint8, mode="r")
    docs = len(IndexedDataset(str(out), mmap=True).document_indices) - 1
    manifest = {
        "format": MANIFEST_FORMAT, "kind": "sft", "num_documents": docs, "num_tokens": int(tokens.size),
        "num_target_tokens": int(targets.sum()), "max_token_id": int(tokens.max()) if tokens.size else -1,
        "dtype": np.dtype(dtype).name,
        "tokenizer": {"hash": tok.hash, "vocab_size": tok.vocab_size, "special_ids": tok.special_ids,
                      "path": str(tokenizer_path)},
        "chat_template": {"hash": template_hash(template, kwargs), "kwargs": kwargs} if template else None,
        "loss_on": loss_on, "inputs": paths,
        "sha256": {"bin": sha256_file(Path(f"{out}.bin")), "idx": sha256_file(Path(f"{out}.idx")),
                   "target_bin": sha256_file(Path(f"{target_prefix(out)}.bin")),
                   "target_idx": sha256_file(Path(f"{target_prefix(out)}.idx"))},
        "seconds": round(elapsed, 3), "docs_per_s": round(docs / max(elapsed, 1e-9), 1),
    }
    del tokens, targets
    write_manifest(out, manifest)
    log(f"wrote {docs} conversations, {manifest['num_tokens']} tokens ({manifest['num_target_tokens']} targets) to "
        f"{out}.bin/.idx and {target_prefix(out)}.bin/.idx in {elapsed:.1f}s")
    return manifest


__all__ = ["preprocess_sft", "target_prefix", "read_template", "encode_unit", "TARGET_SUFFIX"]
