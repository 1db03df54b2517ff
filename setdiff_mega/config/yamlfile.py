"""Reading YAML files strictly: a mapping that sets the same key twice is refused, naming the file, the key's
dotted path and both lines (PyYAML's ``safe_load`` keeps the last value silently).

The file is composed into PyYAML's node tree first (:func:`yaml.compose`), every mapping node is walked with
its path, and only then constructed with ``safe_load``; ``<<`` merge keys are left to PyYAML (overriding a
merged key is how merges are meant to be used).
"""
from __future__ import annotations

from pathlib import Path

import yaml


class DuplicateKey(ValueError):
    """A YAML mapping sets one key twice (the message names file, key and lines)."""


def _duplicates(node, path: str, where: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<":
                line = key_node.start_mark.line + 1
                name = f"{path}.{key}" if path else key
                if key in seen:
                    raise DuplicateKey(f"{where} sets '{name}' twice (lines {seen[key]} and {line}); keep one "
                                       f"(YAML would silently use the last)")
                seen[key] = line
                _duplicates(value_node, name, where)
            else:
                _duplicates(value_node, path, where)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _duplicates(item, f"{path}[{i}]", where)


def read_yaml(path: str | Path, what: str = "YAML file", error=ValueError):
    """The document of ``path`` (None when empty); a key set twice (:class:`DuplicateKey`) or invalid YAML is
    raised as one-line ``error``."""
    text = Path(path).read_text()
    try:
        _duplicates(yaml.compose(text, Loader=yaml.SafeLoader), "", f"{what} '{path}'")
        return yaml.safe_load(text)
    except DuplicateKey as e:
        raise error(str(e)) from None
    except yaml.YAMLError as e:
        raise error(f"{what} '{path}' is not valid YAML: {e}") from None


__all__ = ["read_yaml", "DuplicateKey"]
