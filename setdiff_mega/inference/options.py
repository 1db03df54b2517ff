"""Decoding options from the command line or key=value pairs, with the checkpoint's defaults and the
paper's evaluation protocols as presets.

One place turns user input into a :class:`~setdiff_mega.decoding.base.GenerationConfig` for
``tools/generate.py``, ``tools/evaluate.py`` and the lm-eval adapter:

    defaults   window W = the checkpoint's D (SetDLM), block size = the training block (BD3LM) or 32
               (MDLM), context length = the training length L
    preset     the reference's settings of one evaluation (method.md 7), W given as a multiple of D
    overrides  explicit flags / key=value pairs (they win)

The flags are generated from GenerationConfig's schema (decoding/schema.py); docs/guide/decoding.md's table,
generated from it too, maps every option to the reference's name.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from setdiff_mega import methods
from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.decoding.base import GenerationConfig
from setdiff_mega.decoding.config import OPTIONS
from setdiff_mega.hfmodel.linears import AUTO, CHOICES

# the paper's protocols (method.md 7); "window_per_D" scales the checkpoint's D
PRESETS: dict[str, dict] = {
    "gsm8k": {"tau": 0.9, "fht_cache_order": True, "stop_regex": r"\\boxed\{.*?\}", "stop_regex_count": 2,
              "stop_repeat": 8, "window_per_D": 1},
    "cnndm": {"tau": 1e6, "repetition_penalty": 1.2, "length_penalty": (80, 1.1), "window_per_D": 1},
    "owt": {"tau": 1e6, "temperature": 1.0, "top_p": 0.95, "repetition_penalty": 1.05, "stop_confidence": 0.01,
            "stop_patience": 4, "min_new_tokens": 128, "window_per_D": 1},
    "infill": {"tau": 1e6, "repetition_penalty": 1.2, "infill_full_context": True, "window_per_D": 2},
}

# the CLI's decoding flags: every GenerationConfig option with a flag in its schema (decoding/schema.py)
FLAGS = {name: o for name, o in OPTIONS.items() if o.cli is not None}
_TYPES = {"int": int, "float": float, "str": str, "pair": str}     # "pair": START,FACTOR, parsed by the schema


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """``--chat`` and ``--chat-template-kwargs`` (tools/generate.py, tools/evaluate.py)."""
    p.add_argument("--chat", action="store_true", help="render prompts with the checkpoint tokenizer's chat template "
                   "and its generation prompt (a model fine-tuned on conversations; JSONL lines may be "
                   "{\"messages\": [...]})")
    p.add_argument("--chat-template-kwargs", default="{}", help="--chat: JSON keyword arguments of the template, "
                   "e.g. '{\"enable_thinking\": false}' (as the data was preprocessed)")


def chat_from_args(tok, args):
    """The :class:`~setdiff_mega.data.chat.ChatRenderer` of ``--chat`` (None without it)."""
    return ChatRenderer.of(tok, args.chat_template_kwargs) if args.chat else None


def add_generation_arguments(p: argparse.ArgumentParser, max_new_tokens: int = 64) -> None:
    """The decoding flags shared by the tools (defaults None: the checkpoint / preset decide)."""
    g = p.add_argument_group("decoding (docs/guide/decoding.md)")
    g.add_argument("--preset", choices=sorted(PRESETS), help="the reference's settings of one evaluation")
    for o in FLAGS.values():
        if o.kind == "bool":                 # a switch away from the default (--no-cache sets use_cache False)
            g.add_argument(o.cli, action="store_true", help=o.help)
        elif o.kind == "strings":
            g.add_argument(o.cli, action="append", default=[], help=o.help + " (repeatable)")
        else:
            g.add_argument(o.cli, dest=o.dest, type=_TYPES[o.kind], default=None, help=o.help)
    g.add_argument("--engine", choices=("auto", "plain", "native"), default="auto",
                   help="an unsharded model (TP = PP = 1) decodes through the plain-PyTorch forward of the export "
                        "format whichever is named; a sharded one through megatron-core (native)")
    g.add_argument("--decode-weights", choices=CHOICES, default=AUTO,
                   help="how the plain forward reads the weights: auto (default: fp32-packed on a CPU, its tokens "
                        "equal fp32's on the golden tests; fp32 on a GPU), fp32 (exact: megatron-core's forward bit "
                        "for bit), fp32-packed (packed kernels, CPU), bf16, int8 (torchao weight-only); "
                        "docs/guide/generation.md")
    p.set_defaults(_max_new_tokens_default=max_new_tokens)


def layered(objective_cfg, seq_length: int, preset: str | None = None, overrides: dict | None = None,
            base: GenerationConfig | None = None) -> GenerationConfig:
    """Checkpoint defaults -> preset -> overrides (already typed values or strings), not yet validated."""
    o = objective_cfg
    cfg = base or GenerationConfig()
    cfg = replace(cfg, **methods.decoding_defaults(o, seq_length))
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
        spec = dict(PRESETS[preset])
        window = o.options.preset_window(spec.pop("window_per_D"))
        if window is not None:
            spec["window"] = window
        cfg = replace(cfg, **spec)
    if overrides:
        cfg = GenerationConfig.from_strings({k: v for k, v in overrides.items() if v is not None}, cfg)
    return cfg


def generation_config(objective_cfg, seq_length: int, preset: str | None = None, overrides: dict | None = None,
                      base: GenerationConfig | None = None) -> GenerationConfig:
    """:func:`layered`, validated (once: the samplers' own check of it is then free)."""
    return layered(objective_cfg, seq_length, preset, overrides, base).validate()


def config_from_args(args, objective_cfg, seq_length: int) -> GenerationConfig:
    """A GenerationConfig from :func:`add_generation_arguments` flags."""
    over = {}
    for name, o in FLAGS.items():
        value = getattr(args, o.dest, None)
        if o.kind == "bool":
            value = o.flag_value if value else None
        elif o.kind == "strings":
            value = tuple(value) if value else None
        over[name] = value
    if over["max_new_tokens"] is None:
        over["max_new_tokens"] = args._max_new_tokens_default
    return generation_config(objective_cfg, seq_length, args.preset, over)


__all__ = ["PRESETS", "FLAGS", "add_generation_arguments", "generation_config", "layered", "config_from_args",
           "add_chat_arguments", "chat_from_args"]
