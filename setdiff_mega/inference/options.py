"""Decoding options from the command line or key=value pairs, with the checkpoint's defaults and the
paper's evaluation protocols as presets.

One place turns user input into a :class:`~setdiff_mega.decoding.base.GenerationConfig` for
``tools/generate.py``, ``tools/evaluate.py`` and the lm-eval adapter:

    defaults   window W = the checkpoint's D (SetDLM), block size = the training block (BD3LM) or 32
               (MDLM), context length = the training length L
    preset     the reference's settings of one evaluation (method.md 7), W given as a multiple of D
    overrides  explicit flags / key=value pairs (they win)

The README's "Decoding options" table maps every option to the reference's name (a test keeps it complete).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from setdiff_mega import methods
from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.decoding.base import GenerationConfig
from setdiff_mega.hfmodel.linears import FORMATS

# the paper's protocols (method.md 7); "window_per_D" scales the checkpoint's D
PRESETS: dict[str, dict] = {
    "gsm8k": {"tau": 0.9, "fht_cache_order": True, "stop_regex": r"\\boxed\{.*?\}", "stop_regex_count": 2,
              "stop_repeat": 8, "window_per_D": 1},
    "cnndm": {"tau": 1e6, "repetition_penalty": 1.2, "length_penalty": (80, 1.1), "window_per_D": 1},
    "owt": {"tau": 1e6, "temperature": 1.0, "top_p": 0.95, "repetition_penalty": 1.05, "stop_confidence": 0.01,
            "stop_patience": 4, "min_new_tokens": 128, "window_per_D": 1},
    "infill": {"tau": 1e6, "repetition_penalty": 1.2, "infill_full_context": True, "window_per_D": 2},
}

_FLAGS = [  # (option, type, help)
    ("max_new_tokens", int, "positions generated after a plain prompt (may run past L)"),
    ("window", int, "SetDLM window W (default: the checkpoint's D)"),
    ("tau", float, "commit threshold; > 1 commits one token per step"),
    ("commit_k", int, "tokens always committed per step (the most confident ones, or see --commit-rule)"),
    ("commit_rule", str, "which k tokens are always committed: confidence (the paper), leftmost (AR-anchored) or "
                         "auto (leftmost for a SetDLM with the AR head shift, else confidence)"),
    ("block_size", int, "BD3LM / MDLM block (default: training block / 32)"),
    ("temperature", float, "0 = greedy"), ("top_p", float, "nucleus filter"),
    ("repetition_penalty", float, "> 1 penalises tokens already in the context"),
    ("length_penalty", str, "START,FACTOR: exponential-decay EOS boost after START generated tokens"),
    ("context_length", int, "cache + chunk budget (default: the training length L)"),
    ("min_new_tokens", int, "no EOS / confidence / entropy stop before this many generated tokens"),
    ("stop_regex", str, "stop once the prompt + generation has --stop-regex-count matches"),
    ("stop_regex_count", int, "matches needed by --stop-regex"),
    ("stop_repeat", int, "stop on a run of this many identical tokens"),
    ("stop_confidence", float, "stop after --stop-patience committed tokens below this confidence"),
    ("stop_patience", int, "consecutive low-confidence tokens that stop"),
    ("stop_entropy", float, "stop when the entropy of the last --stop-entropy-window tokens is lower"),
    ("stop_entropy_window", int, "window of --stop-entropy"), ("seed", int, "sampling seed"),
]


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
    g = p.add_argument_group("decoding (README: 'Decoding options')")
    g.add_argument("--preset", choices=sorted(PRESETS), help="the reference's settings of one evaluation")
    for name, typ, text in _FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=text)
    g.add_argument("--no-cache", action="store_true", help="recompute every step (exactness reference)")
    g.add_argument("--no-eos-stop", action="store_true", help="do not stop plain prompts at EOS")
    g.add_argument("--fht-cache-order", action="store_true", help="SetDLM: cache same-step commits in FHT order")
    g.add_argument("--prefix-only-infill", action="store_true", help="SetDLM infill: prefill the prefix only")
    g.add_argument("--speculative", action="store_true",
                   help="SetDLM self-speculation (method.md 16): the model's own greedy left-to-right (AR mode) "
                        "tokens, drafted by the window and verified by the AR head, several per forward; needs a "
                        "checkpoint trained with model.shift_logits and objective.ar_weight > 0")
    g.add_argument("--static-shapes", action="store_true",
                   help="SetDLM: one shape for every decode step (exported model on CUDA: CUDA-graph replay)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--engine", choices=("auto", "plain", "native"), default="auto",
                   help="an unsharded model (TP = PP = 1) decodes through the plain-PyTorch forward of the export "
                        "format whichever is named; a sharded one through megatron-core (native)")
    g.add_argument("--decode-weights", choices=FORMATS, default="fp32",
                   help="how the plain forward reads the weights: fp32 (exact), fp32-packed (oneDNN, CPU), bf16, "
                        "int8 (torchao weight-only); README 'Decoding speed'")
    p.set_defaults(_max_new_tokens_default=max_new_tokens)


def generation_config(objective_cfg, seq_length: int, preset: str | None = None, overrides: dict | None = None,
                      base: GenerationConfig | None = None) -> GenerationConfig:
    """Checkpoint defaults -> preset -> overrides (already typed values or strings)."""
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
    return cfg.validate()


def config_from_args(args, objective_cfg, seq_length: int) -> GenerationConfig:
    """A GenerationConfig from :func:`add_generation_arguments` flags."""
    over = {name: getattr(args, name) for name, _, _ in _FLAGS}
    if over["max_new_tokens"] is None:
        over["max_new_tokens"] = args._max_new_tokens_default
    flags = {"use_cache": False if args.no_cache else None, "stop_at_eos": False if args.no_eos_stop else None,
             "fht_cache_order": True if args.fht_cache_order else None,
             "infill_full_context": False if args.prefix_only_infill else None,
             "static_shapes": True if args.static_shapes else None,
             "speculative": True if getattr(args, "speculative", False) else None,
             "stop_strings": tuple(args.stop) if args.stop else None}
    return generation_config(objective_cfg, seq_length, args.preset, {**over, **flags})


__all__ = ["PRESETS", "add_generation_arguments", "generation_config", "config_from_args", "add_chat_arguments",
           "chat_from_args"]
