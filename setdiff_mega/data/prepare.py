"""Corpus -> tokenizer -> indexed dataset, the preparation step behind ``tools/prepare_data.py``.

Output directory layout (``out``):
    tokenizer.json                     byte-level BPE with <|bos|> <|eos|> <|pad|> <|mask|>
    corpus.bin / corpus.idx            one document per text: [BOS] tokens [EOS]
    corpus.manifest.json               counts, dtype, tokenizer hash + special ids, SHA-256s
    tasks/math.jsonl, tasks/stories.jsonl   (embedded corpus only) held-out task documents for evaluation
"""
from __future__ import annotations

import time
from pathlib import Path

from .corpus import embedded_corpus, read_documents, write_jsonl
from .indexed import DataError, write_indexed
from .tokenizer import Tokenizer


def encode_documents(tokenizer: Tokenizer, texts: list[str], add_bos: bool = True, add_eos: bool = True,
                     batch: int = 1024):
    """Yield token lists ([BOS] ids [EOS]) with the exact fast encoder (or batched encoding)."""
    from .fast_encode import FastEncoder

    enc = FastEncoder(tokenizer)
    for s in range(0, len(texts), batch):
        chunk = texts[s:s + batch]
        for ids in enc.encode_batch(chunk):
            yield ([tokenizer.bos] if add_bos else []) + ids + ([tokenizer.eos] if add_eos else [])


def prepare(out: str | Path, texts: list[str] | None = None, *, tokenizer_path: str | None = None,
            vocab_size: int = 2048, num_math: int = 12000, num_stories: int = 12000, seed: int = 0,
            heldout: int = 200, log=print) -> dict:
    """Build (or reuse) the tokenizer and write ``out/corpus.{bin,idx}``; returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if texts is None:
        docs = embedded_corpus(num_math, num_stories, seed)
        held, docs = docs[:heldout], docs[heldout:]
        write_jsonl([d for d in held if d["task"] == "math"], out / "tasks" / "math.jsonl")
        write_jsonl([d for d in held if d["task"] == "story"], out / "tasks" / "stories.jsonl")
        texts = [d["text"] for d in docs]
        log(f"generated {len(texts)} documents (+{heldout} held out for tasks) in {time.time() - t0:.1f}s")
    if not texts:
        raise DataError("the input holds no documents")
    if tokenizer_path:
        tok = Tokenizer.from_file(tokenizer_path)
    else:
        t1 = time.time()
        tok = Tokenizer.train(texts, vocab_size=vocab_size)
        log(f"trained byte-level BPE, vocab {tok.vocab_size}, in {time.time() - t1:.1f}s")
    tok.save(out / "tokenizer.json")
    t2 = time.time()
    info = {"hash": tok.hash, "vocab_size": tok.vocab_size, "special_ids": tok.special_ids}
    manifest = write_indexed(out / "corpus", encode_documents(tok, texts), tok.vocab_size, info)
    log(f"wrote {manifest['num_documents']} documents, {manifest['num_tokens']} tokens "
        f"({manifest['dtype']}) to {out / 'corpus'}.bin/.idx in {time.time() - t2:.1f}s")
    return manifest


def prepare_from_files(out: str | Path, inputs: list[str], json_key: str = "text", **kw) -> dict:
    texts = [t for path in inputs for t in read_documents(path, json_key)]
    return prepare(out, texts, **kw)


__all__ = ["prepare", "prepare_from_files", "encode_documents"]
