#!/usr/bin/env python
"""Import benchmark (not a test): a random checkpoint with Qwen3-1.7B-Base's shapes, in bf16, through
``convert_checkpoint.py from-hf``; wall time and peak resident memory against the checkpoint's size.

    python tools/bench_convert.py [--out-dir runs/bench_convert] [--layers 28] [--keep]

Qwen3-1.7B-Base's shapes: 28 layers, hidden 2048, 16 query / 8 KV heads of 128, MLP 6144, vocabulary
151,936, tied embeddings, q / k norms (1.72B parameters, 3.4 GB in bf16). The checkpoint is written once
(random values, sharded safetensors with an index, as ``save_pretrained`` writes it, plus a small
tokenizer with ``<|endoftext|>`` and ``<|fim_middle|>``) in a child process, then imported in another
child process (``from-hf --objective setdlm --D 4``), whose peak RSS (``ru_maxrss`` of the child) is
the figure: the target is <= 1.5x the checkpoint's size (the model held once, in bf16, plus one tensor
and the current shard's pages). Prints the numbers and writes ``bench_convert.json``.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from setdiff_mega.cli import run_cli
from setdiff_mega.outputs import claim_output_dir, marked_by

QWEN3_1P7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, torch_dtype="bfloat16")
TOOL = "bench_convert"


def write_checkpoint(path: Path, layers: int, shard_bytes: int = 1 << 30) -> int:
    """Random bf16 tensors with the shapes above, in shards of about ``shard_bytes`` (one shard in memory at
    a time); returns the checkpoint's bytes."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    c = {**QWEN3_1P7B, "num_hidden_layers": layers}
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (16 * d, h), p + "self_attn.k_proj.weight": (8 * d, h),
                       p + "self_attn.v_proj.weight": (8 * d, h), p + "self_attn.o_proj.weight": (h, 16 * d),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    g = torch.Generator().manual_seed(0)
    shards, current, size, total = [], {}, 0, 0
    for name, shape in shapes.items():
        current[name] = (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        size += current[name].numel() * 2
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    shards.append(current)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in shard})
        total += (path / name).stat().st_size
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({**c, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                                  "hidden_act": "silu"}))
    vocab = {"<|endoftext|>": 0, "<|fim_middle|>": 1, **{f"t{i}": i for i in range(2, 1000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>", "<|fim_middle|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                            "pad_token": "<|endoftext|>"}))
    return total


def child_peak(cmd: list) -> tuple:
    """(wall seconds, peak RSS bytes) of one child process (``os.wait4``: its own rusage; KiB on Linux)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return wall, usage.ru_maxrss * 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="runs/bench_convert")
    p.add_argument("--layers", type=int, default=28, help="fewer for a quick run (the shapes of one layer stay)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous bench_convert output")
    p.add_argument("--write-checkpoint", metavar="DIR", help=argparse.SUPPRESS)     # the writer child
    args = p.parse_args(argv)
    if args.write_checkpoint:
        print(write_checkpoint(Path(args.write_checkpoint), args.layers))
        return 0
    out = claim_output_dir(args.out_dir, [], flag="--out-dir", tool=TOOL, overwrite=args.overwrite,
                           owned=marked_by(TOOL))
    src, dst = out / "qwen3_1p7b_shapes", out / "imported"
    src.mkdir()
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, __file__, "--write-checkpoint", str(src), "--layers", str(args.layers)],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"writing the checkpoint failed:\n{r.stderr[-3000:]}")
    size = int(r.stdout.split()[-1])
    wall, peak = child_peak([sys.executable, str(root / "tools" / "convert_checkpoint.py"), "from-hf", str(src),
                             str(dst), "--objective", "setdlm", "--D", "4"])
    result = {"layers": args.layers, "checkpoint_bytes": size, "import_seconds": round(wall, 1),
              "peak_rss_bytes": peak, "peak_rss_over_checkpoint": round(peak / size, 3), "target": 1.5}
    (out / "bench_convert.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"checkpoint {size / 2 ** 30:.2f} GiB (bf16, {args.layers} layers): import {wall:.1f} s, peak RSS "
          f"{peak / 2 ** 30:.2f} GiB = {peak / size:.2f}x the checkpoint (target <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
