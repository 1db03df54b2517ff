"""Megatron-format indexed datasets (``.bin``/``.idx``) with a JSON manifest, written atomically.

Writing goes through megatron-core's ``IndexedDatasetBuilder`` (so Megatron-LM reads our data and we
read theirs). Token dtype is uint16 when the vocabulary fits, else int32. Files are first written as
``<prefix>.tmp-<pid>.bin/.idx`` and renamed into place; the manifest ``<prefix>.manifest.json`` is
written last, so a dataset whose manifest exists is complete:

    {"format": "setdiff-mega/indexed-v1", "num_documents", "num_tokens", "max_token_id", "dtype",
     "tokenizer": {"hash", "vocab_size", "special_ids"}, "sha256": {"bin", "idx"}}

:func:`check_dataset` validates a prefix before training: files exist, the ``.idx`` header is
megatron-core's (checked here, before megatron-core opens it), the ``.bin`` size matches the index,
every token id is below the model vocabulary, and, given the tokenizer, the manifest's tokenizer hash is
the tokenizer's (a dataset without a manifest, e.g. written by Megatron-LM, must at least not contain the
tokenizer's MASK id, which no model ever predicts).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType, IndexedDataset, IndexedDatasetBuilder

from setdiff_mega.errors import DataError
from setdiff_mega.hfmodel.integrity import sha256_file
from setdiff_mega.outputs import OutputError, check_output_file

MANIFEST_FORMAT = "setdiff-mega/indexed-v1"




def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 65500 else np.int32


def manifest_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.manifest.json")


def write_indexed(prefix: str | Path, documents: Iterable[list[int]], vocab_size: int,
                  tokenizer_info: dict | None = None) -> dict:
    """Write token documents to ``prefix.bin/.idx`` atomically and return the manifest."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{prefix}.tmp-{os.getpid()}")
    dtype = token_dtype(vocab_size)
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    n_docs = n_tok = 0
    max_id = -1
    try:
        for doc in documents:
            arr = np.asarray(doc, dtype=np.int64)
            if arr.size == 0:
                continue
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= vocab_size:
                raise DataError(f"document {n_docs} has token id {hi if hi >= vocab_size else lo} outside "
                                f"the vocabulary [0, {vocab_size}) while writing '{prefix}.bin'")
            builder.add_item(torch.from_numpy(arr))
            builder.end_document()
            n_docs += 1
            n_tok += arr.size
            max_id = max(max_id, hi)
        if n_docs == 0:
            raise DataError(f"no non-empty documents to write to '{prefix}.bin': the input is empty")
        builder.finalize(f"{tmp}.idx")
        manifest_path(prefix).unlink(missing_ok=True)   # an old manifest must not bless new files
        os.replace(f"{tmp}.bin", f"{prefix}.bin")
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
    finally:
        for ext in (".bin", ".idx"):
            Path(f"{tmp}{ext}").unlink(missing_ok=True)
    manifest = {
        "format": MANIFEST_FORMAT, "num_documents": n_docs, "num_tokens": n_tok, "max_token_id": max_id,
        "dtype": np.dtype(dtype).name, "tokenizer": tokenizer_info or {"vocab_size": vocab_size},
        "sha256": {"bin": sha256_file(Path(f"{prefix}.bin")), "idx": sha256_file(Path(f"{prefix}.idx"))},
    }
    write_manifest(prefix, manifest)
    return manifest


def check_output_prefix(prefix: str | Path, inputs=(), overwrite: bool = False, flag: str = "--output-prefix") -> Path:
    """Before any work: ``prefix.bin/.idx/.manifest.json`` may not be an input, ``prefix`` not a directory
    nor under a file, and an existing dataset there is replaced only with ``overwrite`` and only when this
    project's preprocessing wrote it (its manifest); a .bin/.idx pair from anywhere else is never replaced."""
    o = Path(prefix)
    if o.is_dir():
        raise OutputError(f"{flag} '{prefix}' is a directory; give a file prefix inside it, e.g. '{o / 'corpus'}'")
    files = [Path(f"{prefix}.bin"), Path(f"{prefix}.idx"), manifest_path(prefix)]
    for f in files:
        check_output_file(f, inputs, flag=flag, overwrite=True)     # not an input, not a dir, parent a dir
    existing = [f for f in files[:2] if f.exists()]
    if not existing:
        return o
    if read_manifest(prefix) is None:
        raise OutputError(f"{flag} '{prefix}': '{existing[0]}' exists and was not written by setdiff-mega's "
                          f"preprocessing (no manifest); it is never replaced: choose another {flag}")
    if not overwrite:
        raise OutputError(f"{flag} '{prefix}' already holds a dataset ({prefix}.bin/.idx): choose another "
                          f"{flag}, or pass --overwrite to replace it")
    return o


def write_manifest(prefix: str | Path, manifest: dict) -> None:
    """Write ``<prefix>.manifest.json`` atomically (the last step of every dataset write)."""
    tmp = Path(f"{manifest_path(prefix)}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, manifest_path(prefix))


def read_manifest(prefix: str | Path) -> dict | None:
    p = manifest_path(prefix)
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"manifest '{p}' is not valid JSON ({e.msg}); re-run the preprocessing") from None


def check_index_header(prefix: str | Path) -> None:
    """The ``.idx`` is a complete megatron-core index: magic, version 1, a known dtype code, and the size
    its counts imply (header 34 bytes + int32 lengths and int64 pointers per sequence + int64 document
    offsets). Checked before megatron-core opens the file, whose failures end in a traceback of its own."""
    f = Path(f"{prefix}.idx")
    fix = "regenerate the dataset with tools/preprocess_data.py"
    with open(f, "rb") as fh:
        head = fh.read(len(_INDEX_HEADER) + 25)
    if head[:len(_INDEX_HEADER)] != _INDEX_HEADER:
        raise DataError(f"index file '{f}' does not start with megatron-core's index header {_INDEX_HEADER!r} "
                        f"(found {head[:len(_INDEX_HEADER)]!r}): it is not a Megatron .idx or it is corrupt; {fix}")
    if len(head) < len(_INDEX_HEADER) + 25:
        raise DataError(f"index file '{f}' is truncated inside its header ({f.stat().st_size} bytes); {fix}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(_INDEX_HEADER):])
    if version != 1 or code not in {d.value for d in DType}:
        raise DataError(f"index file '{f}' has version {version} / dtype code {code} (expected version 1 and a "
                        f"megatron-core DType code); {fix}")
    want, got = len(_INDEX_HEADER) + 25 + 12 * n_seq + 8 * n_doc, f.stat().st_size
    if got != want:
        raise DataError(f"index file '{f}' has {got} bytes but its header ({n_seq} sequences, {n_doc} document "
                        f"offsets) implies {want}: it is truncated or corrupt; {fix}")


def check_tokenizer(prefix: str | Path, manifest: dict | None, tokenizer, field: str = "data.tokenizer") -> None:
    """Refuse a dataset whose manifest names a tokenizer other than ``tokenizer`` (hash mismatch)."""
    info = (manifest or {}).get("tokenizer") or {}
    want = info.get("hash")
    if want is None or want == tokenizer.hash:
        return
    raise DataError(f"dataset '{prefix}' was tokenized with tokenizer {want} (vocabulary {info.get('vocab_size')}) "
                    f"but {field} '{tokenizer.source}' is tokenizer {tokenizer.hash} (vocabulary "
                    f"{tokenizer.vocab_size}): set {field} to the tokenizer.json the data was made with, or "
                    f"re-tokenize the data with this one (data.check_tokenizer=false skips the check)")


def check_dataset(prefix: str | Path, vocab_size: int | None = None, verify_hashes: bool = False,
                  tokenizer=None) -> dict:
    """Validate a dataset prefix; returns {num_documents, num_tokens, max_token_id, manifest}.

    ``tokenizer``: also check that the data was made with it (see :func:`check_tokenizer`)."""
    prefix = Path(prefix)
    for ext in (".bin", ".idx"):
        if not Path(f"{prefix}{ext}").is_file():
            raise DataError(f"data file '{prefix}{ext}' does not exist; set data.path to the prefix of an "
                            f"existing .bin/.idx pair or create it with tools/prepare_data.py")
    check_index_header(prefix)
    try:
        ds = IndexedDataset(str(prefix), mmap=True)
    except Exception as e:  # mcore raises AssertionError / struct errors on bad headers
        raise DataError(f"index file '{prefix}.idx' is unreadable or corrupt ({type(e).__name__}: {e}); "
                        f"regenerate the dataset") from None
    dtype = np.dtype(ds.index.dtype)
    expected = int(ds.index.sequence_pointers[-1]) + int(ds.index.sequence_lengths[-1]) * dtype.itemsize \
        if len(ds.index.sequence_lengths) else 0
    actual = os.path.getsize(f"{prefix}.bin")
    if actual != expected:
        raise DataError(f"data file '{prefix}.bin' has {actual} bytes but its index expects {expected}: the "
                        f".bin is truncated or does not belong to '{prefix}.idx'; regenerate the dataset")
    manifest = read_manifest(prefix)
    if manifest is not None and verify_hashes:
        for ext in ("bin", "idx"):
            got = sha256_file(Path(f"{prefix}.{ext}"))
            if got != manifest["sha256"][ext]:
                raise DataError(f"'{prefix}.{ext}' does not match the SHA-256 in its manifest: the file changed "
                                f"after preprocessing; regenerate the dataset")
    if manifest is not None:
        n_tok, max_id = manifest["num_tokens"], manifest["max_token_id"]
    else:
        tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r")
        n_tok, max_id = int(tokens.size), int(tokens.max()) if tokens.size else -1
    info = {"num_documents": len(ds.document_indices) - 1, "num_tokens": n_tok, "max_token_id": max_id,
            "manifest": manifest, "dtype": dtype.name}
    check_matches(prefix, info, vocab_size, tokenizer)
    return info


def check_matches(prefix: str | Path, info: dict, vocab_size: int | None, tokenizer=None) -> None:
    """Given :func:`check_dataset`'s ``info``: every token id is below ``vocab_size``, and the data was made
    with ``tokenizer`` (its manifest's hash; without a manifest, the data must not hold the MASK id)."""
    max_id = info["max_token_id"]
    if tokenizer is not None and info["manifest"] is not None:     # the precise reason first
        check_tokenizer(prefix, info["manifest"], tokenizer)
    if vocab_size is not None and max_id >= vocab_size:
        raise DataError(f"dataset '{prefix}' holds token id {max_id} but the model vocabulary has only "
                        f"{vocab_size} entries: use the tokenizer the data was made with, or raise "
                        f"model.vocab_size to at least {max_id + 1}")
    if tokenizer is None or info["manifest"] is not None:
        return
    tokens = np.memmap(f"{prefix}.bin", dtype=np.dtype(info["dtype"]), mode="r")
    if tokens.size and tokenizer.mask <= max_id and bool((tokens == tokenizer.mask).any()):
        raise DataError(f"dataset '{prefix}' (no manifest) contains token id {tokenizer.mask}, the MASK token of "
                        f"data.tokenizer '{tokenizer.source}', which no model predicts: the data was made with "
                        f"another tokenizer; set data.tokenizer to that one or re-tokenize the data")



class DataWatch:
    """Stops a run whose data files change under it. The trainer reads ``.bin`` / ``.idx`` through memory
    maps: a file deleted or replaced by rename keeps serving its old bytes (so a resume would read other
    data than this run did), and one truncated in place makes the next read of a lost page kill the
    process with SIGBUS and no message. ``check()`` (every step, two ``stat`` calls per file) compares
    each file's inode, size and modification time with the values at the start and raises one DataError
    naming the file."""

    def __init__(self, prefixes):
        self.files = {f: self._id(f) for p in prefixes for f in (Path(f"{p}.bin"), Path(f"{p}.idx"))}

    @staticmethod
    def _id(f: Path):
        try:
            st = f.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def check(self) -> None:
        for f, ident in self.files.items():
            now = self._id(f)
            if now != ident:
                what = "was deleted" if now is None else ("was replaced" if now[0] != ident[0] else "was modified")
                raise DataError(f"data file '{f}' {what} while training: the run stops (the data it trained on can "
                                f"no longer be read back, and a truncated memory-mapped file would crash the "
                                f"process); restore the dataset and resume with train.resume=auto from the last "
                                f"checkpoint")


__all__ = ["DataError", "DataWatch", "sha256_file", "write_indexed", "check_output_prefix", "write_manifest",
           "check_dataset", "check_tokenizer", "check_matches", "check_index_header", "read_manifest", "manifest_path",
           "token_dtype"]
