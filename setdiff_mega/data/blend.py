"""``data.path``: one dataset prefix, or a blend ``"0.7 data/a/corpus 0.3 data/b/corpus"`` (megatron-core's
BlendedDataset weights, respected per sample). Parsing it needs nothing heavy (the config tools and the sweeps
read it without megatron-core)."""
from __future__ import annotations

from setdiff_mega.errors import DataError


def parse_blend(path: str) -> tuple[list[str], list[float] | None]:
    """'data/a/corpus' -> ([prefix], None); '0.7 data/a/corpus 0.3 data/b/corpus' -> (prefixes, weights)."""
    parts = str(path).split()
    if len(parts) == 1:
        return parts, None
    if len(parts) % 2:
        raise DataError(f"data.path={path!r}: a blend is 'weight prefix weight prefix ...' (got an odd count)")
    try:
        weights = [float(w) for w in parts[0::2]]
    except ValueError:
        raise DataError(f"data.path={path!r}: a blend is 'weight prefix weight prefix ...'") from None
    if any(w <= 0 for w in weights):
        raise DataError(f"data.path={path!r}: blend weights must be positive")
    return parts[1::2], weights


__all__ = ["parse_blend"]
