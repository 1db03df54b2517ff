"""Input records -> document text, with the rules Megatron-LM's ``tools/preprocess_data.py`` applies and
errors that name the file and line.

A record's value under a JSON key (or a parquet / datasets column) is:

    str               one document
    list of str       one document made of sentences: each sentence is tokenized on its own and the
                      token lists are concatenated, one sequence per non-empty sentence (Megatron's
                      sentence layout; empty sentences are dropped, as there)
    anything else     refused with the line (or row) number: null, numbers, booleans, objects and lists
                      holding non-strings are never stringified ("None", "42", "['a']")

Several keys: string values are joined with a newline into one document (a list there is refused).
Input must be UTF-8; an undecodable byte is reported as ``<file>:<line>: ... byte 0xe9 at column 13``
with the line counted in the whole file, not in the worker's unit.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable  # noqa: F401  (``where`` may be one)

from .indexed import DataError

Document = "str | list[str]"


def line_of(path: str | Path, offset: int) -> int:
    """1-based line number of byte ``offset`` in ``path`` (counts newlines before it; used on errors only)."""
    n, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            chunk = f.read(min(1 << 22, offset - done))
            if not chunk:
                break
            n += chunk.count(b"\n")
            done += len(chunk)
    return n


def utf8_error(where: str, data: bytes, e: UnicodeDecodeError) -> DataError:
    """``where`` = 'file:line'; ``data`` = the line's bytes; the column is 1-based in bytes."""
    return DataError(f"{where}: not valid UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1}); re-encode "
                     f"the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT) or drop the line")


def _describe(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def document(record, keys: list[str], where) -> Document:
    """The document of one record (a parsed JSON object or a row dict); ``where`` (a string, or a callable
    returning one: computed on errors only) names it in errors."""
    if isinstance(record, dict) and all(isinstance(record.get(k), str) for k in keys):   # the common case
        return record[keys[0]] if len(keys) == 1 else "\n".join(record[k] for k in keys)
    where = where() if callable(where) else where
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with the keys {keys}, got {type(record).__name__} "
                        f"{_describe(record)}")
    missing = [k for k in keys if k not in record]
    if missing:
        raise DataError(f"{where}: JSON key '{missing[0]}' does not exist (keys: {', '.join(map(str, record))}); "
                        f"pass the right key (--json-keys; prepare_data.py: --json-key)")
    values = [record[k] for k in keys]
    for k, v in zip(keys, values):
        ok = isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
        if not ok:
            what = "null" if v is None else f"{type(v).__name__} {_describe(v)}"
            raise DataError(f"{where}: the value of '{k}' is {what}; a document must be a string, or "
                            f"a list of strings (sentences, as Megatron-LM reads them): fix or drop the record")
    if len(values) == 1:
        return values[0]
    if any(isinstance(v, list) for v in values):
        raise DataError(f"{where}: a list of sentences is read for one --json-keys key only (keys {keys}); "
                        f"preprocess each key separately")
    return "\n".join(values)


def as_text(doc: Document) -> str:
    """A document as one string (sentences concatenated, as their tokens are)."""
    return doc if isinstance(doc, str) else "".join(doc)


__all__ = ["document", "as_text", "line_of", "utf8_error"]
