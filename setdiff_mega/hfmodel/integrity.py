"""SHA-256 checksums of an export's files, written at export and verified on load.

``SHA256SUMS`` holds one ``<hex digest>  <file name>`` line per file of the export (the format of
coreutils' ``sha256sum``, so ``sha256sum -c SHA256SUMS`` checks a copy by hand), except the model card
``README.md`` (people edit it) and hidden files. Loading (this package's ``from_pretrained`` and the
native loader) re-hashes every listed file: a weight file with a flipped bit (same size, parseable) is
reported with its name instead of decoding silently with wrong numbers. Exports written before checksums
existed have no ``SHA256SUMS`` and load unchecked.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

CHECKSUMS = "SHA256SUMS"
UNCHECKED = ("README.md", CHECKSUMS)


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(directory) -> Path:
    """Write ``SHA256SUMS`` over the files of ``directory`` (sorted names)."""
    d = Path(directory)
    files = sorted(p for p in d.iterdir() if p.is_file() and p.name not in UNCHECKED and not p.name.startswith("."))
    out = d / CHECKSUMS
    out.write_text("".join(f"{sha256_file(p)}  {p.name}\n" for p in files))
    return out


def verify_checksums(fetch: Callable[[str], object]) -> str | None:
    """None when every file listed in ``SHA256SUMS`` has its digest, else what is wrong (one sentence).
    ``fetch(name)``: the local path of an export file, or None when it is absent."""
    listing = fetch(CHECKSUMS)
    if listing is None:
        return None
    for n, line in enumerate(Path(listing).read_text().splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            return f"{CHECKSUMS} line {n} is not '<sha256>  <file>'"
        path = fetch(name)
        if path is None:
            return f"{name} is missing (listed in {CHECKSUMS}): the copy is incomplete; copy the whole directory again"
        if sha256_file(path) != digest:
            return (f"{name} does not match its SHA-256 in {CHECKSUMS}: it was corrupted or changed after the "
                    f"export; copy it again (if you changed it on purpose, update its line in {CHECKSUMS})")
    return None


__all__ = ["CHECKSUMS", "sha256_file", "write_checksums", "verify_checksums"]
