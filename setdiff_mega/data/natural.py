"""A natural corpus available offline on every machine: the Python sources installed with the interpreter and the
project's pinned packages (``tools/prepare_data.py --natural``; issue 41's scaling-law study).

Sources: the standard library (``sysconfig`` ``stdlib``, without ``site-packages``) and the packages named in
:data:`PACKAGES` found on ``sys.path`` (their versions are pinned by ``pyproject.toml``, so every machine that ran
``scripts/setup.sh`` holds the same files). Each ``.py`` file is a document; a file longer than ``max_chars`` is cut
at blank lines into pieces of at most that length (a piece may exceed it only where one block between blank lines
does). Then:

* deduplication: exact duplicates (after stripping trailing whitespace per line) are kept once, the first in
  path order; vendored copies of one module in two packages are the common case;
* a fixed-seed shuffle of the documents, so that the contiguous document ranges Megatron's split
  (``data.split``, e.g. 969,30,1) takes for validation hold every source in proportion: train and validation
  are split by document and share none (exact duplicates removed);
* a cap of ``max_mb`` megabytes of text, applied after the shuffle.

The provenance (Python version, each source's root, version, files and bytes, documents dropped as duplicates, and
the SHA-256 of the documents in order) is :func:`natural_documents`' record, written to ``natural.json``: a
``--skip-existing`` run reuses the corpus only when the record of this machine's sources is identical.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# pure-Python packages the project pins (pyproject.toml): code and docstrings of varied style. Left out:
# transformers, whose model files are near-copies of each other ("Copied from"), which exact deduplication keeps
# and which would put near-duplicates on both sides of the train / validation split; and packages that arrive
# unpinned (pip, setuptools, torch's dependencies such as sympy or networkx), which would make the corpus differ
# between machines.
PACKAGES = ("datasets", "deepspeed", "megatron", "torch/_dynamo", "torch/distributed", "matplotlib", "yaml", "httpx")
NATURAL_VERSION = 1


@dataclass(frozen=True)
class Source:
    name: str                 # "stdlib" or the package path under a sys.path entry
    root: Path
    version: str


def default_sources(packages=PACKAGES) -> list[Source]:
    """The standard library and every package of ``packages`` importable here (those absent are skipped)."""
    out = [Source("stdlib", Path(sysconfig.get_paths()["stdlib"]), sys.version.split()[0])]
    for name in packages:
        for entry in map(Path, sys.path):
            root = entry / name
            if entry.is_dir() and root.is_dir() and "site-packages" in entry.parts:
                out.append(Source(name, root, _version(name.split("/")[0])))
                break
    return out


def _version(dist: str) -> str:
    alias = {"megatron": "megatron-core", "yaml": "PyYAML"}.get(dist, dist)
    try:
        return importlib.metadata.version(alias)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def source_files(src: Source) -> list[Path]:
    """The source's ``.py`` files in path order (the standard library without its site-packages)."""
    files = sorted(p for p in src.root.rglob("*.py") if p.is_file())
    if src.name == "stdlib":
        files = [p for p in files if not {"site-packages", "dist-packages"} & set(p.relative_to(src.root).parts)]
    return files


def split_long(text: str, max_chars: int) -> list[str]:
    """``text`` in pieces of at most ``max_chars``, cut at blank lines (module docstring)."""
    if len(text) <= max_chars:
        return [text]
    pieces, cur = [], ""
    for block in text.split("\n\n"):
        if cur and len(cur) + 2 + len(block) > max_chars:
            pieces.append(cur)
            cur = block
        else:
            cur = f"{cur}\n\n{block}" if cur else block
    return [p for p in pieces + [cur] if p.strip()]


def natural_documents(sources: list[Source], *, max_chars: int = 16000, max_mb: float = 40.0, seed: int = 0,
                      log=print) -> tuple[list[str], dict]:
    """(documents, provenance record) of ``sources`` (module docstring)."""
    seen, docs, record = set(), [], {"version": NATURAL_VERSION, "python": sys.version.split()[0], "seed": seed,
                                     "max_chars": max_chars, "max_mb": max_mb, "sources": []}
    for src in sources:
        files = source_files(src)
        kept = dup = undecodable = size = 0
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                undecodable += 1
                continue
            text = "\n".join(line.rstrip() for line in text.splitlines()).strip()
            if not text:
                continue
            raw = text.encode()
            key = hashlib.sha256(raw).digest()
            if key in seen:
                dup += 1
                continue
            seen.add(key)
            kept += 1
            size += len(raw)
            docs += split_long(text, max_chars)
        record["sources"].append({"name": src.name, "root": str(src.root), "version": src.version,
                                  "files": len(files), "kept": kept, "duplicates": dup,
                                  "undecodable": undecodable, "bytes": size})
        log(f"natural corpus: {src.name} {src.version}: {kept} files ({size / 1e6:.1f} MB), {dup} duplicates")
    random.Random(seed).shuffle(docs)
    budget, total, capped = int(max_mb * 1e6), 0, []
    for d in docs:
        n = len(d.encode())
        if total + n > budget:
            break
        capped.append(d)
        total += n
    digest = hashlib.sha256()
    for d in capped:
        digest.update(hashlib.sha256(d.encode()).digest())
    record.update(documents=len(capped), documents_before_cap=len(docs), bytes=total, sha256=digest.hexdigest())
    return capped, record


def natural_is_current(recorded: dict | None, record: dict) -> bool:
    """Whether a corpus built with ``recorded`` (its ``natural.json``) holds the documents ``record`` describes:
    the same builder version, options and document digest (the sources' paths may differ between machines)."""
    keys = ("version", "seed", "max_chars", "max_mb", "documents", "sha256")
    return recorded is not None and all(recorded.get(k) == record.get(k) for k in keys)


__all__ = ["PACKAGES", "Source", "default_sources", "source_files", "split_long", "natural_documents",
           "natural_is_current"]
