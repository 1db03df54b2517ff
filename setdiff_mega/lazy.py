"""Package namespaces whose names resolve on first use (PEP 562), so that importing one light module of a
package (``data.batch``, ``checkpoint.io``, ``training.flops``) does not import the package's heavy modules
(megatron-core, the trainer) through its ``__init__``."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict):
    """The ``__getattr__`` of a package whose ``exports`` maps a name to the submodule defining it."""

    def __getattr__(name):
        if name in exports:
            return getattr(importlib.import_module(f".{exports[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__


__all__ = ["lazy_exports"]
