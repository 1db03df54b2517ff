"""GGUF files in: ``tools/convert_checkpoint.py from-gguf FILE SAVE_DIR`` (FILE a path, or ``pkg:PACKAGE/PATH``: a
file an installed package ships, :mod:`setdiff_mega.package_files`).

A GGUF file (llama.cpp's format: the architecture's hyperparameters, the tokenizer, the chat template and the
tensors, most of them quantised in blocks, in one file) becomes a native checkpoint in three steps, the last of
which is ``from-hf`` itself:

1. :func:`read_header` reads the header (gguf's reader, memory-mapped: no tensor data is read) and refuses, with
   one line, a file that is not GGUF, an architecture other than :data:`ARCHITECTURES` and a tensor type other
   than :data:`TYPES`;
2. :func:`dequantize` unpacks it with transformers' own GGUF loader (its config and tokenizer mapping, its
   tensor-name map with the reverse of llama.cpp's q / k row permutation, gguf's ``dequantize``) into a Hugging
   Face directory: ``config.json``, ``model.safetensors`` (every tensor in fp32: the blocks' values exactly as
   gguf computes them; F16 / BF16 widen exactly), ``tokenizer.json`` and ``tokenizer_config.json`` with the chat
   template. The directory is a staging directory next to SAVE_DIR (``.<name>.gguf-<owner>-...``, removed
   afterwards; a killed run's is swept by the next one, :mod:`setdiff_mega.staging`);
3. :func:`~.families.import_model` imports that directory: the family's adapter (GGUF ``llama`` is Llama, or
   Mistral when transformers reads it so), the adopted tokenizer and MASK, the objective and every override
   exactly as ``from-hf``.

The checkpoint's ``state.json`` records the source under ``gguf`` (:func:`provenance`: the file, its sha256,
architecture, name, file type and tensor types): **the imported model is the dequantised fp32 model**, not the
release the file was quantised from; the quantisation error is part of it. An export of the checkpoint
(``to-hf``) says so in its model card. Memory: the dequantised fp32 tensors once (written to the staging
directory and released), then the native model once, as ``from-hf`` holds it.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from setdiff_mega import package_files
from setdiff_mega.staging import make_staging, sweep_leftovers

from . import convert, families
from .adapters.base import quiet_transformers
from .io import CheckpointError

# GGUF ``general.architecture`` values read here (transformers' GGUF loader maps them to its config; the family
# adapter of that config imports the weights)
ARCHITECTURES = ("llama",)
# tensor types read (gguf dequantises them; each is checked against transformers' loader in the tests)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
PARENT = ("the dequantised fp32 model: every tensor of the GGUF file unpacked to float32 exactly as gguf's "
          "dequantize computes it (the quantisation error is part of this model; it is not the release the file "
          "was quantised from)")


@dataclass(frozen=True)
class Header:
    path: Path
    architecture: str
    name: str | None
    file_type: str | None
    types: dict              # tensor type name -> number of tensors of that type
    tensors: int
    vocab: int | None        # the tokenizer's tokens (tokenizer.ggml.tokens)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading a GGUF file needs the gguf package (pinned in pyproject.toml): run "
                              "bash scripts/setup.sh") from None
    return gguf


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def read_header(path: str | Path) -> Header:
    """The file's architecture, name, file type and tensor types (no tensor data read); refuses what
    :func:`dequantize` does not read (see the module docstring)."""
    gguf = _gguf()
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"GGUF file '{p}' does not exist")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:          # gguf raises ValueError / struct / index errors on bad or truncated files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"'{p}' is not a readable GGUF file ({first}); point at a .gguf file (a complete "
                              f"download)") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"'{p}': GGUF architecture '{arch}' is not supported (supported: "
                              f"{', '.join(ARCHITECTURES)}); import the model's Hugging Face directory with from-hf "
                              f"instead")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    bad = {k: n for k, n in types.items() if k not in TYPES}
    if bad:
        first = next(t for t in reader.tensors if t.tensor_type.name in bad)
        more = sum(bad.values()) - 1
        also = f" (and {more} more of type {', '.join(bad)})" if more else ""
        raise CheckpointError(f"'{p}': tensor '{first.name}' is {first.tensor_type.name}{also}, a quantisation type "
                              f"that is not supported (supported: {', '.join(TYPES)}); use a file of one of those "
                              f"types (llama.cpp's llama-quantize writes them)")
    ftype = _field(reader, "general.file_type")
    try:
        ftype = gguf.LlamaFileType(int(ftype)).name if ftype is not None else None
    except ValueError:
        ftype = str(ftype)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return Header(p, arch, _field(reader, "general.name"), ftype, dict(types), len(reader.tensors),
                  len(tokens.data) if tokens is not None else None)


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def provenance(header: Header, source: str) -> dict:
    """What ``state.json`` records under ``gguf``."""
    import importlib.metadata

    import transformers

    return {"source": source, "file": str(header.path), "sha256": _sha256(header.path),
            "bytes": header.path.stat().st_size, "architecture": header.architecture, "name": header.name,
            "file_type": header.file_type, "tensor_types": header.types,
            "dequantized_to": "float32", "parent": PARENT,
            "dequantized_with": f"gguf {importlib.metadata.version('gguf')}, transformers {transformers.__version__}"}


def dequantize(header: Header, out: str | Path) -> Path:
    """The GGUF file as a Hugging Face directory of fp32 tensors in ``out`` (an existing, empty directory):
    config.json, model.safetensors, the tokenizer and its chat template (see the module docstring)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = Path(out)
    where, name = str(header.path.parent), header.path.name
    with quiet_transformers():
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config
        with torch.device("meta"):            # names and shapes only: the loader maps GGUF names onto it
            model = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(header.path), return_tensors=True, model_to_load=model)["tensors"]
        wanted = [k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")]
        missing = [k for k in wanted if k not in tensors]
        if missing:
            raise CheckpointError(f"'{header.path}' holds no tensor for '{missing[0]}'"
                                  f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: the file is "
                                  f"not a complete {header.architecture} model")
        save_file({k: tensors.pop(k).to(torch.float32).contiguous() for k in wanted}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        del tensors
        config.architectures = [type(model).__name__]
        config.dtype = torch.float32
        config.save_pretrained(str(out))
        AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(str(out))
    raw = json.loads((out / "config.json").read_text())
    raw.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    _only_the_files_tokens(out / "tokenizer.json", header.vocab)
    return out


def _only_the_files_tokens(f: Path, vocab: int | None) -> None:
    """transformers' GGUF tokenizer converter adds the GPT-2 converter's ``<|endoftext|>`` when the file's
    vocabulary lacks it: a token past the file's list, with no embedding row; the tokenizer keeps the file's."""
    if vocab is None:
        return
    tj = json.loads(f.read_text())
    extra = [t for t in tj.get("added_tokens", []) if t["id"] >= vocab]
    if extra:
        tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < vocab]
        for t in extra:
            if tj["model"].get("vocab", {}).get(t["content"]) == t["id"]:
                del tj["model"]["vocab"][t["content"]]
        f.write_text(json.dumps(tj, ensure_ascii=False))


def resolve(source: str | Path) -> Path:
    """A path or ``pkg:PACKAGE/PATH`` -> the GGUF file (CheckpointError naming it when absent)."""
    try:
        p = package_files.resolve(source)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None
    if not p.is_file():
        raise CheckpointError(f"GGUF file '{p}' does not exist" + (" (it is a directory: name the .gguf file in it)"
                                                                   if p.is_dir() else ""))
    return p


STAGING = ".{}.gguf-"


def import_gguf(source: str | Path, save_dir: str | Path, overrides=(), mask_token: str | None = None,
                overwrite: bool = False, dtype: str = "auto") -> Path:
    """A GGUF file (a path or ``pkg:PACKAGE/PATH``) -> a weights-only native checkpoint under ``save_dir``
    (returns its dir); the options and output rules of :func:`.families.import_model` (from-hf)."""
    path = resolve(source)
    header = read_header(path)
    save_dir = Path(save_dir)
    convert.check_import_target(save_dir, path, overwrite)          # refused before any work
    parent = save_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    prefix = STAGING.format(save_dir.name)
    sweep_leftovers(parent, (prefix,))
    tmp = make_staging(parent, prefix)
    try:
        dequantize(header, tmp)
        record = provenance(header, str(source))
        return families.import_model(tmp, save_dir, overrides, mask_token, overwrite=overwrite, dtype=dtype,
                                     state={"imported_from": str(source), "gguf": record})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["ARCHITECTURES", "TYPES", "PARENT", "Header", "read_header", "dequantize", "import_gguf", "provenance",
           "resolve"]
