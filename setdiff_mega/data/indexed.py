"""Megatron-format indexed datasets (``.bin``/``.idx``) with a JSON manifest, written atomically.

Writing goes through megatron-core's ``IndexedDatasetBuilder`` (so Megatron-LM reads our data and we
read theirs). Token dtype is uint16 when the vocabulary fits, else int32. Files are first written as
``<prefix>.tmp-<pid>.bin/.idx`` and renamed into place; the manifest ``<prefix>.manifest.json`` is
written last, so a dataset whose manifest exists is complete:

    {"format": "setdiff-mega/indexed-v1", "num_documents", "num_tokens", "max_token_id", "dtype",
     "tokenizer": {"hash", "vocab_size", "special_ids"}, "sha256": {"bin", "idx"}}

:func:`check_dataset` validates a prefix before training: files exist, the index is readable, the
``.bin`` size matches the index, and every token id is below the model vocabulary.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

MANIFEST_FORMAT = "setdiff-mega/indexed-v1"


class DataError(ValueError):
    """Bad or mismatched data; the message names the file and the fix."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 65500 else np.int32


def manifest_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.manifest.json")


def write_indexed(prefix: str | Path, documents: Iterable[list[int]], vocab_size: int,
                  tokenizer_info: dict | None = None) -> dict:
    """Write token documents to ``prefix.bin/.idx`` atomically and return the manifest."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

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
        "sha256": {"bin": _sha256(Path(f"{prefix}.bin")), "idx": _sha256(Path(f"{prefix}.idx"))},
    }
    write_manifest(prefix, manifest)
    return manifest


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


def check_dataset(prefix: str | Path, vocab_size: int | None = None, verify_hashes: bool = False) -> dict:
    """Validate a dataset prefix; returns {num_documents, num_tokens, max_token_id, manifest}."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = Path(prefix)
    for ext in (".bin", ".idx"):
        if not Path(f"{prefix}{ext}").is_file():
            raise DataError(f"data file '{prefix}{ext}' does not exist; set data.path to the prefix of an "
                            f"existing .bin/.idx pair or create it with tools/prepare_data.py")
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
            got = _sha256(Path(f"{prefix}.{ext}"))
            if got != manifest["sha256"][ext]:
                raise DataError(f"'{prefix}.{ext}' does not match the SHA-256 in its manifest: the file changed "
                                f"after preprocessing; regenerate the dataset")
    if manifest is not None:
        n_tok, max_id = manifest["num_tokens"], manifest["max_token_id"]
    else:
        tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r")
        n_tok, max_id = int(tokens.size), int(tokens.max()) if tokens.size else -1
    if vocab_size is not None and max_id >= vocab_size:
        raise DataError(f"dataset '{prefix}' holds token id {max_id} but the model vocabulary has only "
                        f"{vocab_size} entries: use the tokenizer the data was made with, or raise "
                        f"model.vocab_size to at least {max_id + 1}")
    return {"num_documents": len(ds.document_indices) - 1, "num_tokens": n_tok, "max_token_id": max_id,
            "manifest": manifest}


__all__ = ["DataError", "write_indexed", "write_manifest", "check_dataset", "read_manifest", "manifest_path", "token_dtype"]
