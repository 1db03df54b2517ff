"""The records of a preprocessing work unit (:class:`~setdiff_mega.data.preprocess.WorkUnit`), with their
place for errors.

:func:`read_records` yields ``(record, where)`` of a JSONL unit (a newline-aligned byte range: one JSON
object per line; ``where()`` = ``file:line`` counted in the whole file) or of a parquet row group / datasets
index range (``where()`` = ``file (row group g, row r)``); :func:`read_unit` the documents of pretraining
data (:func:`~setdiff_mega.data.records.document`; plain text: blank-line separated blocks). Supervised data
(:mod:`.sft`) reads the records themselves.
"""
from __future__ import annotations

import json

from .corpus import read_documents
from .indexed import DataError
from .records import document, line_of, utf8_error


def _jsonl(unit):
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        data = f.read(unit.stop - unit.start)
    for n, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue

        def where(n=n) -> str:                     # the line in the file (computed on errors only)
            return f"{unit.path}:{line_of(unit.path, unit.start) + n}"
        try:
            rec = json.loads(line)
        except UnicodeDecodeError as e:
            raise utf8_error(where(), line, e) from None
        except json.JSONDecodeError as e:
            raise DataError(f"{where()}: not valid JSON ({e.msg} at column {e.colno})") from None
        yield rec, where


def read_records(unit, columns: list[str] | None = None):
    """Yield ``(record, where)`` of a JSONL / parquet / datasets unit; ``columns``: the columns a parquet /
    datasets row must have (None: all of its columns)."""
    if unit.kind == "jsonl":
        yield from _jsonl(unit)
        return
    if unit.kind == "parquet":
        import pyarrow.parquet as pq  # gated: parquet inputs only (pyarrow costs a second of start-up)

        table = pq.ParquetFile(unit.path).read_row_group(unit.start)
        names, column = table.column_names, lambda k: table.column(k).to_pylist()
        label, first_row = f"{unit.path} (row group {unit.start}, row", 0
    elif unit.kind == "hfdisk":
        from datasets import load_from_disk  # gated: datasets directories only (slow to import)

        part = load_from_disk(unit.path).select(range(unit.start, unit.stop))
        names, column = part.column_names, lambda k: part[k]
        label, first_row = f"{unit.path} (row", unit.start
    else:
        raise DataError(f"'{unit.path}' is plain text; records come from JSONL, parquet or datasets directories")
    keys = list(names) if columns is None else list(columns)
    cols = [c for c in keys if c not in names]
    if cols:
        raise DataError(f"{unit.path}: column '{cols[0]}' does not exist (columns: {', '.join(names)}); "
                        f"pass the right --json-keys")
    for i, row in enumerate(zip(*[column(k) for k in keys])):
        yield dict(zip(keys, row)), (lambda i=i: f"{label} {first_row + i})")


def read_unit(unit, keys: list[str]):
    """Yield the documents of one work unit: strings, or lists of sentences (:mod:`.records`)."""
    if unit.kind == "text":
        yield from read_documents(unit.path)
        return
    for rec, where in read_records(unit, keys):
        yield document(rec, keys, where)


__all__ = ["read_records", "read_unit"]
