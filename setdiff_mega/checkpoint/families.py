"""Hugging Face models of a supported family in and out of the native format.

``import_model(DIR, SAVE_DIR, overrides)``: ``config.json`` -> its adapter (:mod:`.adapters`) -> ModelConfig
fields (the architecture; the user's overrides choose the objective and everything else) -> a single-process
native model, held in the checkpoint's own dtype (bf16 stays bf16), filled tensor by tensor from the
directory's shards (:class:`.adapters.weights.HFWeights`, so the checkpoint is never held twice) -> a
weights-only megatron-core distributed checkpoint at step 0, which loads into any TP / PP / CP layout
and any precision. The vocabulary is the embedding's rows in the file (never
``vocab_size``); the native model pads it to a multiple of ``make_vocab_size_divisible_by`` with zero rows.

The tokenizer is adopted from the directory (``tokenizer.json``; roles from ``tokenizer_config.json``:
BOS = ``bos_token`` or EOS, PAD = ``pad_token`` or EOS; the chat template kept). MASK is the tokenizer's
own ``mask_token`` if it has one, else ``mask_token`` (``--mask-token``), else the family's usual token
(:attr:`.adapters.Adapter.mask_tokens`: ``<|fim_middle|>`` for Qwen, ``<|reserved_special_token_0|>`` for
Llama 3) when the vocabulary has it, else a new token ``<|mask|>``: its embedding row (and head row and
bias) is the mean of the others.

``export_model(CHECKPOINT, OUT)`` (``to-hf --format hf``): an AR checkpoint of an imported family in that
family's own layout and ``config.json`` (written by transformers' config class), sharded safetensors,
the tokenizer; plain ``transformers`` loads it without remote code. HF -> native -> HF is bit-identical.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from setdiff_mega.config import ConfigError, load_config, validate
from setdiff_mega.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from setdiff_mega.model import build_model
from setdiff_mega.outputs import check_output_dir, marked_by, staged_dir
from setdiff_mega.parallel import initialize

from . import adapters, convert, hf
from .adapters import layout
from .adapters.base import normalised, quiet_transformers
from .adapters.weights import HFWeights
from .io import CheckpointError
from .native import load_model, save_model_checkpoint

EMBEDDING = "embedding.word_embeddings.weight"


def read_config(path: Path) -> dict:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"'{path}' has no config.json: point at a Hugging Face model directory")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"'{f}' is not valid JSON ({e})") from None


def _token(value) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _role(tc: dict, raw: dict, vocab, role: str) -> str | None:
    """A special token from tokenizer_config.json, else from config.json's ``<role>_token_id``."""
    token = _token(tc.get(f"{role}_token"))
    ident = raw.get(f"{role}_token_id")
    if token is None and isinstance(ident, int) and ident < vocab.get_vocab_size():
        token = vocab.id_to_token(ident)
    return token


def adopt_tokenizer(path: Path, adapter, mask_token: str | None, rows: int, raw: dict) -> tuple:
    """(the directory's tokenizer with its roles and MASK, the ids whose rows the import sets to the mean: a
    MASK token it added, unless config.json says the model was trained with it); see the module docstring."""
    from tokenizers import Tokenizer as HFTokenizer

    f = path / "tokenizer.json"
    if not f.is_file():
        raise CheckpointError(f"'{path}' has no tokenizer.json: save the model's fast tokenizer next to the weights "
                              f"(AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR))")
    tc_file = path / "tokenizer_config.json"
    tc = json.loads(tc_file.read_text()) if tc_file.is_file() else {}
    vocab = HFTokenizer.from_file(str(f))
    known = vocab.get_vocab_size()
    if known > rows:
        raise CheckpointError(f"'{f}' has {known} tokens, more than the {rows} rows of the "
                              f"embedding: the tokenizer belongs to another model; use the model's own tokenizer")
    eos = _role(tc, raw, vocab, "eos")
    if eos is None or vocab.token_to_id(eos) is None:
        raise CheckpointError(f"'{tc_file}' names no EOS token of the tokenizer (eos_token); add it")
    trained = raw.get("mask_token_id")                  # a diffusion release: MASK's row is trained
    own = _role(tc, raw, vocab, "mask")
    family = next((t for t in adapter.mask_tokens if vocab.token_to_id(t) is not None), None)
    mask = own or mask_token or family or SPECIAL_TOKENS["mask"]
    if mask_token and not own and vocab.token_to_id(mask_token) is None:
        raise CheckpointError(f"--mask-token {mask_token!r} is not a token of '{f}'; name an existing token, or "
                              f"leave it out to add a new MASK token")
    try:
        tok = Tokenizer.adopt(f, bos=_role(tc, raw, vocab, "bos") or eos, eos=eos,
                              pad=_role(tc, raw, vocab, "pad") or eos, mask=mask)
    except ValueError as e:
        raise CheckpointError(f"'{f}': {e}; name another MASK token with --mask-token") from None
    if isinstance(trained, int) and tok.mask != trained:
        raise CheckpointError(f"'{path / 'config.json'}' says MASK is id {trained}, the tokenizer gives "
                              f"{tok.token(tok.mask)!r} id {tok.mask}: use the release's own tokenizer")
    template = tc.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    tok.chat_template = template if isinstance(template, str) else None
    return tok, range(0) if isinstance(trained, int) else range(known, tok.vocab_size)


def storage_precision(raw: dict, dtype: str) -> str:
    """The precision the imported weights are held in: ``dtype`` fp32 | bf16, or auto: the checkpoint's own
    (``torch_dtype`` / ``dtype`` bfloat16 -> bf16, so a 7B import holds the model once, in its size;
    anything else -> fp32, which holds fp16 exactly)."""
    if dtype not in ("auto", "fp32", "bf16"):
        raise CheckpointError(f"import dtype {dtype!r} is not one of auto, fp32, bf16")
    if dtype != "auto":
        return dtype
    return "bf16" if str(raw.get("torch_dtype", raw.get("dtype"))) in ("bfloat16", "torch.bfloat16") else "fp32"


def load_family(path: str | Path, overrides=(), mask_token: str | None = None, dtype: str = "fp32"):
    """(model, RunConfig, tokenizer, adapter) of a Hugging Face directory of a supported family, in this
    (single) process; the weights held in ``dtype`` (:func:`storage_precision`)."""
    p = Path(path)
    raw = read_config(p)
    source = f"'{p / 'config.json'}'"
    if hf.is_hf_export(p):
        model, _, tok, cfg = load_model(p)
        return model, cfg, tok, adapters.detect(raw, source)
    weights = HFWeights(p)
    adapter = adapters.detect(raw, source, weights.names())
    embed = layout.match(adapter.rules, EMBEDDING, None)[1][0]
    if embed not in weights:
        raise CheckpointError(f"'{p}' has no tensor '{embed}' (the embedding): the weights are not a "
                              f"{adapter.name} model's")
    fields = adapter.to_model(normalised(raw) if adapter.transformers_config else raw, source, weights.shapes)
    weights = adapter.fold(weights)
    rows = weights.shapes[embed][0]
    tok, new = adopt_tokenizer(p, adapter, mask_token, rows, raw)
    method = adapter.objective(raw) if adapter.objective else []
    try:
        cfg = load_config(None, method + list(overrides), check=False)
        cfg.model = dataclasses.replace(cfg.model, **fields, vocab_size=max(rows, tok.vocab_size))
        validate(cfg)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None
    initialize(seed=cfg.train.seed)
    model = build_model(cfg.model, cfg.model.vocab_size, precision=storage_precision(raw, dtype), initialize=False)
    file_mc = dataclasses.replace(cfg.model, vocab_size=rows)
    _fill(model, weights, file_mc, adapter, p, new=new)
    return model.eval(), cfg, tok, adapter


def _fill(model, weights: HFWeights, file_mc, adapter, path: Path, new: range) -> None:
    """The model's tensors from ``weights`` (checked first); the rows of ``new`` tokens (a MASK token added
    to the tokenizer) are the mean of the tokenizer's other tokens' rows."""
    state = model.state_dict()
    ignore = adapter.ignore + ((r"lm_head\.weight",) if file_mc.tie_embeddings else ())
    expected = layout.expected_shapes(state, file_mc, adapter.rules, exact_vocab=adapter.exact_vocab)
    layout.check_tensors(weights.shapes, expected, f"the weights in '{path}'", ignore)
    layout.fill_native(weights.get, state, file_mc, adapter.rules, rank=weights.shard_rank)
    weights.close()
    with torch.no_grad():
        for name, t in layout.tensors(state):
            if len(new) and layout.match(adapter.rules, name, file_mc)[0].vocab:
                t[new.start:new.stop] = t[:new.start].mean(dim=0, keepdim=True)


def import_model(path: str | Path, save_dir: str | Path, overrides=(), mask_token: str | None = None,
                 overwrite: bool = False, dtype: str = "auto", state: dict | None = None) -> Path:
    """A Hugging Face directory (any supported family, or the project's export) -> a weights-only native
    checkpoint under ``save_dir`` (returns its dir); the rules of :func:`convert.check_import_target`.
    ``state``: entries recorded in its state.json over ``imported_from`` / ``family`` (from-gguf's provenance)."""
    p, save_dir = Path(path), Path(save_dir)
    if hf.is_hf_export(p):
        return convert.import_export(p, save_dir, overwrite=overwrite)
    previous = convert.check_import_target(save_dir, p, overwrite)
    model, cfg, tok, adapter = load_family(p, overrides, mask_token, dtype)
    convert.remove_imports(previous, keep="step_0000000")
    return save_model_checkpoint(save_dir, 0, model, cfg, tok, release=True,
                                 state={"imported_from": str(p), "family": adapter.name, **(state or {})})


def _is_family_export(d: Path) -> bool:
    return marked_by(TO_HF_FAMILY)(d)


TO_HF_FAMILY = "convert_checkpoint to-hf --format hf"


def export_model(checkpoint: str | Path, out_dir: str | Path, dtype: str = "fp32", overwrite: bool = False) -> Path:
    """An AR checkpoint of an imported family -> that family's own Hugging Face directory (see the module
    docstring)."""
    if dtype not in convert.DTYPES:
        raise CheckpointError(f"export dtype {dtype!r} is not supported; choose one of {', '.join(convert.DTYPES)}")
    check_output_dir(out_dir, [checkpoint], flag="out_dir", tool=TO_HF_FAMILY, overwrite=overwrite,
                     owned=_is_family_export)
    model, _, tok, cfg = load_model(checkpoint)
    if cfg.model.vocab_size is None:          # trained here with the family's architecture: the tokenizer's vocab
        cfg.model = dataclasses.replace(cfg.model, vocab_size=model.vocab_size)
    mc = cfg.model
    adapter = adapters.get(mc.family) if mc.family else None
    if adapter is None or adapter.to_hf is None:
        raise CheckpointError(f"'{checkpoint}' is not a model of a Hugging Face family (model.family="
                              f"{mc.family}); export it in the project's format (to-hf without --format hf)")
    if not (adapter.any_objective or cfg.objective.method.causal):
        raise CheckpointError(f"'{checkpoint}' was trained with objective {cfg.objective.name}: a {mc.family} model "
                              f"in transformers' layout decodes left to right only; export it in the project's "
                              f"format (to-hf without --format hf), which carries its sampler")
    if mc.shift_logits and not cfg.objective.method.causal:
        raise CheckpointError(f"'{checkpoint}' was trained with model.shift_logits, which the {mc.family} layout "
                              f"cannot record (its readers take the logits unshifted); export it in the project's "
                              f"format (to-hf without --format hf)")
    name, torch_dtype = convert.DTYPES[dtype]
    tensors = {k: v.to(dtype=torch_dtype, copy=True)      # tensors of their own: safetensors refuses shared storage
               for k, v in layout.native_to_hf(model.state_dict(), mc, adapter.rules, exact_vocab=True).items()}
    with staged_dir(out_dir, TO_HF_FAMILY, source=str(checkpoint)) as tmp:
        _write_family(tmp, adapter, cfg, tok, tensors, name)
    return Path(out_dir)


def _write_family(tmp: Path, adapter, cfg, tok: Tokenizer, tensors: dict, dtype_name: str) -> None:
    from huggingface_hub import save_torch_state_dict  # the Hugging Face path's own dependency
    from transformers import AutoConfig

    mc = cfg.model
    fields = {**adapter.to_hf(cfg), "bos_token_id": tok.bos, "eos_token_id": tok.eos, "pad_token_id": tok.pad,
              "mask_token_id": tok.mask, "dtype": dtype_name}
    if adapter.transformers_config:
        with quiet_transformers():
            AutoConfig.for_model(**fields).save_pretrained(str(tmp))
    else:
        (tmp / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    save_torch_state_dict(tensors, str(tmp), max_shard_size="5GB", metadata={"format": "pt"})
    tok.save(tmp / "tokenizer.json")
    special = {"bos_token": tok.token(tok.bos), "eos_token": tok.token(tok.eos), "pad_token": tok.token(tok.pad),
               "mask_token": tok.token(tok.mask)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": mc.max_position_embeddings,
              **special, **({"chat_template": tok.chat_template} if tok.chat_template else {})}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf.write_checksums(tmp)


__all__ = ["import_model", "export_model", "load_family", "storage_precision", "adopt_tokenizer", "read_config"]
