"""Decoding of an exported setdiff-mega model: ``model.generate`` / ``model.infill`` (remote code that
needs torch and transformers only).

The samplers are setdiff-mega's own: ``base.py``, ``baselines.py``, ``cache.py``, ``context.py``,
``processors.py``, ``runner.py``, ``sampling.py``, ``setdlm.py``, ``shift.py`` and ``stopping.py`` are copied verbatim
from ``setdiff_mega/decoding`` (where the training stack's native path imports them too) into every
export, so the exported model and the training stack decode with one implementation (a test matrix
requires identical greedy tokens). They run on the plain-PyTorch model through :class:`DecodeModel`, the
interface they are written against:

    cache_shape()             (layers, KV heads, head dim) of the KV cache
    use_cache(cache)          context manager: the forwards inside it attend [cache ; chunk]
    model(tok, pos, keep, s)  tok / pos [B, T] long, keep [B, T, C + T] bool (True = may attend; C cache
                              slots then the chunk) -> logits [B, T - s, V]
    training_length           the context budget L (cache + chunk <= L; positions keep growing past it)
    shift_logits              the model was trained with the AR head alignment (method.md 13)

``generate(model, input_ids, attention_mask=None, **options)``: each row's tokens (where the attention
mask is 1; left or right padding) start with BOS (prepended when missing, as every training document
does); a row holding MASK tokens is an infill request (``[BOS] prefix MASK*m suffix [EOS]``), any other
row is continued for ``max_new_tokens`` positions. The options are the sampler's
(:class:`GenerationConfig` fields: ``window``, ``tau``, ``commit_k``, ``block_size``, ``temperature``,
``top_p``, ``stop_strings`` ...; ``do_sample=False`` means greedy; ``decode_weights`` = auto | fp32 | fp32-packed |
bf16 | int8 says how the forward reads the weights, :mod:`.linears`: auto, the default, is fp32-packed on a CPU and
fp32 on a GPU, ``linears.resolve``; fp32 is the exact path); their other defaults come from the export's
``generation_config.json`` (the method's: W = D, block size, the training length L). The sampler is the
one ``config.method["sampler"]`` names (:func:`sampler_of`), the method (its name, whether it decodes in blocks:
the trace's windows) is ``config.method``'s ``objective`` and ``block``, both written at export from the registry
record. Output: :class:`SetDLMGenerateOutput` with ``sequences`` [B, N] (each row's whole decoded canvas, prompt
included, right-padded with PAD), ``generated`` (the new tokens per row), ``nfe``, ``steps``, ``tokens_per_step``.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from transformers.utils import ModelOutput, cached_file

from ..decoding.base import Canvas, GenerationConfig
from ..decoding.baselines import ARSampler, BD3LMSampler, MDLMSampler
from ..decoding.schema import from_python
from ..decoding.schema import options as schema_options
from ..decoding.setdlm import SetDLMSampler
from ..decoding.trace import traces
from .capture import CapturedStep
from .decode_step import Prepared
from .decode_step import forward as decode_forward
from .linears import cache_dtype
from .linears import check as check_format
from .linears import resolve as resolve_format

GENERATION_FILE = "generation_config.json"
EXPORTED = {name: o for name, o in schema_options(GenerationConfig).items() if o.export}   # generate() takes


@dataclass
class SetDLMGenerateOutput(ModelOutput):
    sequences: torch.Tensor = None          # [B, N] long: prompt + generation per row, PAD on the right
    generated: list = None                  # per row: the generated tokens (infill: the filled span)
    nfe: int = None                         # model forward passes for the batch (prefill included)
    steps: list = None                      # per row: decoding steps that committed tokens
    tokens_per_step: list = None            # per row: committed tokens / steps
    trace: list = None                      # record=True: per row, the decoding trace (decoding/trace.py) as a dict


class DecodeModel:
    """The samplers' model interface over a ``SetDLMForDiffusionLM`` (see the module docstring); each call
    is one :func:`.decode_step.forward` over the model's prepared (fused) weights, through the KV cache
    that :meth:`use_cache` installs."""

    def __init__(self, model, context_length: int | None = None, decode_weights: str = "fp32"):
        self.model, c = model, model.config
        self.decode_weights = check_format(decode_weights)          # how the products read weights (.linears)
        self.cache_dtype = cache_dtype(decode_weights)               # the KV cache's (None: the model's)
        self.training_length = context_length or c.method.get("seq_length")
        self.shift_logits = bool(getattr(c, "shift_logits", False))    # the AR head alignment (shift.py)
        self.self_speculative = bool(c.method.get("self_speculative", False))   # its drafts verifiable (speculative.py)
        self.vocab_size = c.tokenizer_vocab_size
        self._cache = None
        self._prepared = getattr(model, "_setdiff_prepared", None)     # reused across generate() calls
        # static caches (GenerationConfig.static_shapes): one CUDA graph per step signature (CPU: eager)
        self.captured = CapturedStep(lambda *a: decode_forward(self._prepared, *a, self._cache))

    def parameters(self):
        return self.model.parameters()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def eval(self):
        self.model.eval()
        return self

    def cache_shape(self) -> tuple:
        c = self.model.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    @contextlib.contextmanager
    def use_cache(self, cache):
        self._cache = cache
        try:
            yield cache
        finally:
            self._cache = None

    def weights(self) -> Prepared:
        """The fused weights in the decode-weights format, rebuilt when a parameter was replaced or changed in
        place (one prepared copy is kept on the model: the last format asked for)."""
        prepared = Prepared.current(self.model, self._prepared, self.decode_weights)
        if prepared is not self._prepared:
            self._prepared = self.model._setdiff_prepared = prepared
        return prepared

    @property
    def ragged(self) -> bool:
        """Whether calls pass ``valid=`` (decoding/calls.py: a chunk's padding left out of the products): on CPU,
        where the products' arithmetic is the forward's cost (measured: docs/results.md "Serving"); on a GPU a
        decode chunk's forward is bound by kernel launches, and packing adds launches and a host sync."""
        return next(self.model.parameters()).device.type == "cpu"

    def __call__(self, tokens, position_ids, keep, logits_start: int = 0, valid=None):
        w = self.weights()
        if self._cache is not None and self._cache.static:
            return self.captured(tokens, position_ids, keep, logits_start, self._cache, key=id(w))
        return decode_forward(w, tokens, position_ids, keep, logits_start, self._cache, valid)


class TokenizerView:
    """What the stopping criteria ask of a tokenizer (``decode``, ``token``), over a transformers tokenizer,
    decoding exactly as the training stack does (special tokens kept, no clean-up)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token(self, i: int) -> str:
        return self.tok.convert_ids_to_tokens(int(i))


def defaults(model) -> GenerationConfig:
    """The export's decoding defaults (its method's, written at export): ``generation_config.json`` (read by
    ``from_pretrained``), else the copy in ``config.json``."""
    known = {f.name for f in fields(GenerationConfig)}
    saved = getattr(model, "decode_defaults", None) or getattr(model.config, "setdiff_generation", None)
    if not saved:
        raise ValueError("the export has no decoding defaults (generation_config.json, or 'setdiff_generation' in "
                         "config.json): re-export the checkpoint with tools/convert_checkpoint.py to-hf")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in known}
    if saved.get("do_sample") is False:                  # transformers' convention
        values["temperature"] = 0.0
    elif saved.get("do_sample") and "temperature" not in saved:
        values["temperature"] = 1.0
    return replace(GenerationConfig(), **values)


def read_defaults(path) -> dict | None:
    """``generation_config.json`` of an export (a directory or a hub name), or None."""
    try:
        f = cached_file(str(path), GENERATION_FILE, _raise_exceptions_for_missing_entries=False)
    except OSError:
        return None
    if f is None:
        return None
    try:
        return json.loads(Path(f).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"'{f}' is not valid JSON ({e}); re-export the checkpoint") from None


def _overrides(model, kwargs: dict) -> GenerationConfig:
    """Defaults overridden by ``kwargs`` (the options the schema exposes to the export, decoding/schema.py;
    ``do_sample`` as in transformers), not yet validated."""
    cfg = defaults(model)
    do_sample = kwargs.pop("do_sample", None)
    for ignored in ("eos_token_id", "pad_token_id", "bos_token_id", "use_cache_for_prefill"):
        kwargs.pop(ignored, None)
    unknown = sorted(set(kwargs) - set(EXPORTED))
    if unknown:
        raise ValueError(f"unknown generation option(s) {unknown}; options: {', '.join(sorted(EXPORTED))}")
    cfg = replace(cfg, **{k: from_python(k, EXPORTED[k], v) for k, v in kwargs.items()})
    if do_sample is False:
        cfg = replace(cfg, temperature=0.0)
    elif do_sample and cfg.temperature == 0.0:
        cfg = replace(cfg, temperature=1.0)
    return cfg


def options(model, kwargs: dict) -> GenerationConfig:
    """Defaults overridden by ``kwargs`` (GenerationConfig fields; ``do_sample`` as in transformers), validated."""
    return _overrides(model, kwargs).validate()


@dataclass(frozen=True)
class ExportedMethod:
    """What the decoding trace asks of the export's method (decoding/trace.py), from config.json's ``method``
    (written at export from the registry record: ``objective``, ``block``)."""
    name: str
    block: bool

    @classmethod
    def of(cls, m: dict) -> "ExportedMethod":
        return cls(str(m.get("objective")), bool(m.get("block", False)))


SHIPPED = (SetDLMSampler, ARSampler, BD3LMSampler, MDLMSampler)      # the samplers every export carries


def sampler_of(m: dict):
    """The sampler class config.json's ``method.sampler`` names (the registry record's, written at export)."""
    found = [c for c in SHIPPED if c.__name__ == m.get("sampler")]
    if not found:
        raise ValueError(f"config.json 'method.sampler' is {m.get('sampler')!r}; this code decodes "
                         f"{', '.join(c.__name__ for c in SHIPPED)}: re-export the checkpoint with "
                         f"tools/convert_checkpoint.py to-hf")
    return found[0]


def _rows(input_ids, attention_mask, bos_id: int) -> list:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    keep = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else torch.as_tensor(attention_mask).bool()
    if keep.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(keep.shape)}, input_ids {tuple(ids.shape)}")
    rows = []
    for r, k in zip(ids.tolist(), keep.tolist()):
        row = [t for t, ok in zip(r, k) if ok]
        rows.append(row if row[:1] == [bos_id] else [bos_id] + row)
    return rows


def generate(model, input_ids, attention_mask=None, tokenizer=None, return_dict_in_generate: bool = True,
             **kwargs):
    """Decode a batch with the export's sampler (see the module docstring)."""
    c, m = model.config, model.config.method
    kwargs = dict(kwargs)
    p = next(model.parameters())
    decode_weights = resolve_format(kwargs.pop("decode_weights", "auto"), p.device, p.dtype)
    cfg = _overrides(model, kwargs)
    sampler_class = sampler_of(m)
    mask_id, pad_id, eos_id, bos_id = m["mask_token_id"], c.pad_token_id, c.eos_token_id, c.bos_token_id
    rows = _rows(input_ids, attention_mask, bos_id)
    dm = DecodeModel(model, cfg.context_length, decode_weights)
    dm.eval()
    if cfg.context_length is None:
        cfg = replace(cfg, context_length=dm.training_length)
    cfg = cfg.validate()                                      # once: the sampler's own check is then free
    view = None if tokenizer is None else TokenizerView(tokenizer)
    sampler = sampler_class(dm, mask_id, pad_id, eos_id, cfg, tokenizer=view)
    device = next(model.parameters()).device
    canvas = Canvas.from_prompts(rows, mask_id, pad_id, cfg.max_new_tokens, device=device)
    out = sampler.generate(canvas)
    width = max(len(s) for s in out.sequences)
    seqs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for b, s in enumerate(out.sequences):
        seqs[b, :len(s)] = torch.tensor(s, dtype=torch.long)
    if not return_dict_in_generate:
        return seqs
    trace = [asdict(t) for t in traces(ExportedMethod.of(m), canvas, out, cfg)] if cfg.record else None
    return SetDLMGenerateOutput(sequences=seqs, generated=out.tokens, nfe=out.nfe, steps=out.steps,
                                tokens_per_step=out.tokens_per_step, trace=trace)


def infill(model, prefix_ids, suffix_ids, span: int, **kwargs) -> SetDLMGenerateOutput:
    """Fill ``span`` positions between a prefix and a suffix: ``[BOS] prefix MASK*span suffix [EOS]``."""
    c = model.config
    if span < 1:
        raise ValueError(f"span must be >= 1 MASK position, got {span}")
    ids = [c.bos_token_id, *[int(t) for t in prefix_ids], *[c.method["mask_token_id"]] * int(span),
           *[int(t) for t in suffix_ids], c.eos_token_id]
    return generate(model, torch.tensor([ids]), **kwargs)


__all__ = ["generate", "infill", "defaults", "read_defaults", "options", "DecodeModel", "TokenizerView",
           "SetDLMGenerateOutput", "ExportedMethod", "sampler_of", "SHIPPED", "GENERATION_FILE"]
