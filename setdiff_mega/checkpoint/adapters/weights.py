"""The tensors of a Hugging Face model directory, read lazily, one tensor at a time.

Layouts (the first found wins): ``model.safetensors.index.json`` (shards named by its ``weight_map``),
``model.safetensors``, ``pytorch_model.bin.index.json``, ``pytorch_model.bin``. Safetensors shards are
opened with ``safe_open`` (memory-mapped: reading one tensor reads only its bytes); pickle shards with
``torch.load(weights_only=True, mmap=True)`` (no code runs, nothing is read before it is used), kept
open one shard at a time. An importer asks for tensors in shard order (:meth:`HFWeights.by_shard`), so
at any time it holds the model it fills plus one tensor (plus, for pickles, one mapped shard), never the
whole checkpoint twice.

Every failure is one :class:`~setdiff_mega.errors.CheckpointError` naming the file: no weights at all,
an index that is not JSON or lists a missing shard, a shard that is truncated or not a tensor file.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from setdiff_mega.errors import CheckpointError

LAYOUTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")


def _load_pickle(f: Path) -> dict:
    """A ``pytorch_model*.bin`` with ``weights_only`` (never code): memory-mapped when it is a zip-format
    file (torch >= 1.6), read whole when it is a legacy one."""
    try:
        return torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap can only be used" not in str(e):
            raise
        return torch.load(str(f), map_location="cpu", weights_only=True)


class HFWeights:
    """name -> tensor of a model directory (see the module docstring); ``shapes`` needs no tensor data."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        found = next((self.path / f for f in LAYOUTS if (self.path / f).is_file()), None)
        if found is None:
            raise CheckpointError(f"'{self.path}' has no weights ({', '.join(LAYOUTS)}); point at the directory "
                                  f"that holds the model's config.json and weights")
        self.safetensors = "safetensors" in found.name
        self.files = self._files(found)            # name -> the shard that holds it
        self._open: tuple | None = None            # (file, handle) of the shard read last
        self.shapes = {}
        for f in dict.fromkeys(self.files.values()) if self.files else [found]:
            handle = self._handle(f)
            for name in (handle.keys() if self.safetensors else handle):
                if self.files.setdefault(name, f) == f:
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape() if self.safetensors
                                              else handle[name].shape)
        listed = [n for n in self.files if n not in self.shapes]
        if listed:
            raise CheckpointError(f"'{self.files[listed[0]]}' lacks tensor '{listed[0]}' that its index lists; the "
                                  f"download is incomplete: download the shard again")
        self._ranks = {f: i for i, f in enumerate(dict.fromkeys(self.files.values()))}
        self.close()

    def _files(self, found: Path) -> dict:
        if not found.name.endswith(".index.json"):
            return {}                              # one file: filled from its own names
        try:
            weight_map = json.loads(found.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"'{found}' is not a weights index (JSON with a 'weight_map'): {e}") from None
        files = {name: self.path / shard for name, shard in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(f"'{found}' lists the shard '{self.path / missing[0]}', which is missing"
                                  f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; the download "
                                  f"is incomplete: download the missing shards into '{self.path}'")
        return files

    def _handle(self, f: Path):
        if self._open is not None and self._open[0] == f:
            return self._open[1]
        self._open = None                          # release the previous shard before mapping the next
        try:
            handle = safe_open(str(f), "pt") if self.safetensors else _load_pickle(f)
        except (SafetensorError, OSError, RuntimeError, EOFError) as e:
            kind = "safetensors" if self.safetensors else "PyTorch"
            raise CheckpointError(f"'{f}' is truncated or unreadable (not a {kind} weights file: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}); download or copy it "
                                  f"again") from None
        except Exception as e:         # torch's unpickler refusing code: weights_only
            raise CheckpointError(f"'{f}' holds more than tensors ({type(e).__name__}); it is never unpickled with "
                                  f"code: convert it to safetensors with the model's own tools") from None
        if not self.safetensors and not (isinstance(handle, dict) and all(
                isinstance(v, torch.Tensor) for v in handle.values())):
            raise CheckpointError(f"'{f}' does not hold a state dict of tensors")
        self._open = (f, handle)
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def names(self) -> list:
        return list(self.shapes)

    def __iter__(self):
        return iter(self.shapes)

    def items(self):
        """(name, tensor) pairs, shard by shard."""
        return ((name, self.get(name)) for name in self.shard_order(self.shapes))

    def get(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise CheckpointError(f"'{self.path}' has no tensor '{name}'")
        handle = self._handle(self.files[name])
        return handle.get_tensor(name) if self.safetensors else handle[name]

    def shard_rank(self, name: str) -> int:
        """The index of the shard that holds ``name`` (read tensors in this order: each shard mapped once)."""
        return self._ranks.get(self.files.get(name), 0)

    def shard_order(self, names) -> list:
        """``names`` sorted by the shard that holds them."""
        return sorted(names, key=self.shard_rank)

    def close(self) -> None:
        self._open = None


__all__ = ["HFWeights", "LAYOUTS"]
