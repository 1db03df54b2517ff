"""The model card (``README.md``) of a Hugging Face export: the method and its decoding defaults, the
architecture, the training data and run, the validation numbers the checkpoint recorded, and a
copy-paste usage example (generate, infill, the statistics). Everything comes from the checkpoint's
RunConfig, its ``state.json`` and the export's ``config.json``; nothing is measured here.
"""
from __future__ import annotations

import math
from pathlib import Path

_PAPER = "Arriola & Kuleshov, *Set Diffusion Language Models*, ICML 2026"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if math.isfinite(v) else str(v)
    return str(v)


def _method_line(o) -> str:
    return ", ".join([f"objective `{o.name}` ({o.method.label})", *o.options.describe()])


def _usage(meta: dict) -> str:
    g = meta["setdiff_generation"]
    return f'''```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "path/to/this/directory"          # or its hub name
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()

ids = torch.tensor([[tok.bos_token_id] + tok.encode("Question: what is 3 plus 4?", add_special_tokens=False)])
out = model.generate(ids, max_new_tokens=64, window={g["window"]}, tau={g["tau"]})   # greedy by default
print(tok.decode(out.generated[0]))
print("forward passes:", out.nfe, "tokens per step:", out.tokens_per_step[0])

# fill 8 positions between a prefix and a suffix
filled = model.infill(tok.encode("Once upon a time", add_special_tokens=False),
                      tok.encode("and they lived happily.", add_special_tokens=False), span=8)
print(tok.decode(filled.generated[0]))
```'''


def _source(state: dict) -> str:
    """A GGUF import's provenance (``from-gguf``: state.json's ``gguf``): the model is the dequantised one."""
    g = state.get("gguf")
    if not g:
        return ""
    types = ", ".join(f"{n} {t}" for t, n in sorted(g["tensor_types"].items(), key=lambda kv: -kv[1]))
    return f"""
## Source
Imported with `tools/convert_checkpoint.py from-gguf` from the GGUF file `{g["source"]}` ({g["name"]},
{g["architecture"]}, {g["file_type"]}: {types} tensors; sha256 `{g["sha256"]}`), dequantised to
{g["dequantized_to"]} ({g["dequantized_with"]}). The parent model is {g["parent"]}.
"""


def model_card(cfg, state: dict, meta: dict, num_parameters: int, source: Path) -> str:
    """The export's README.md."""
    o, mc, dc, tc = cfg.objective, cfg.model, cfg.data, cfg.train
    g = meta["setdiff_generation"]
    metrics = {k: state[k] for k in ("val_loss", "initial_val_loss", "consumed_samples", "skipped_steps")
               if k in state}
    rows = "\n".join(f"| {k} | {_fmt(v)} |" for k, v in metrics.items()) or "| (none recorded) | |"
    label = o.method.label
    return f"""---
library_name: transformers
tags: [setdiff-mega, diffusion-language-model, {o.name}]
---
# {label} model exported by setdiff-mega

A {label} language model ({_PAPER}) trained with setdiff-mega and exported
with `tools/convert_checkpoint.py to-hf` from `{source}` (step {meta["setdiff_mega_step"]},
{meta["setdiff_mega_weights"]} weights, stored as {meta["torch_dtype"]}). The directory is self-contained:
the modelling code, the samplers and their KV cache are plain PyTorch + transformers
(`trust_remote_code=True`); setdiff-mega is not needed to load or decode it.
{_source(state)}
## Method
- {_method_line(o)}
- decoding defaults (`generation_config.json`): window W = {g["window"]}, tau = {g["tau"]}, commit_k =
  {g["commit_k"]}, block size {g["block_size"]}, context budget L = {g["context_length"]} tokens

## Architecture
{mc.num_layers} layers, hidden size {mc.hidden_size}, {mc.num_attention_heads} heads ({mc.query_groups} KV groups),
FFN {mc.ffn_size} ({mc.activation}), {mc.normalization}, RoPE base {mc.rotary_base}; {num_parameters:,}
parameters; vocabulary {meta["tokenizer_vocab_size"]} tokens (embedding rows {meta["vocab_size"]}).

## Training
- data: `{dc.path}` (tokenizer `{dc.tokenizer or "saved with the data"}`), sequence length {dc.seq_length}
- {tc.train_steps} steps, micro-batch {tc.micro_batch_size}, learning rate {tc.lr} ({tc.lr_schedule}),
  seed {tc.seed}; the full training config is `config.json`'s `setdiff_mega` entry

## Validation (recorded in the checkpoint)
| metric | value |
|---|---|
{rows}

## Usage
{_usage(meta)}

`generate` takes every sampler option as a keyword (`window`, `tau`, `commit_k`, `block_size`,
`temperature`, `top_p`, `repetition_penalty`, `stop_strings` with `tokenizer=tok`, `seed`, ...) and
returns `sequences` (prompt + generation, PAD-padded), `generated`, `nfe`, `steps` and `tokens_per_step`.
A row holding MASK tokens (`{meta["method"]["mask_token_id"]}`) between a prefix and a suffix is decoded as
an infilling request.
"""


__all__ = ["model_card"]
