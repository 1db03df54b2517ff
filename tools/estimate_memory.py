#!/usr/bin/env python
"""Per-rank memory of a training config and layout: parameters, weights, gradients, AdamW state, EMA and
activations (with the configured recomputation and without), no process group needed.

    python tools/estimate_memory.py --config configs/tiny_cpu.yaml
    python tools/estimate_memory.py --config configs/owt_setdlm.yaml --world-size 8 data.seq_length=16384 \\
        parallel.context_parallel_size=4 parallel.tensor_model_parallel_size=2 model.attention_backend=setcausal

The vocabulary is the config's ``model.vocab_size`` or ``--vocab`` (default 50,304 rows: GPT-2's padded);
the formulas are in setdiff_mega/training/memory.py (checked against the model in tests/unit/test_memory.py).
"""
import argparse
import json
import sys

from setdiff_mega.cli import run_cli
from setdiff_mega.config import load_config, validate_layout
from setdiff_mega.model.transformer import padded_vocab_size
from setdiff_mega.outputs import check_output_file, write_file_atomic
from setdiff_mega.training.memory import GIB, estimate, measure_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config (default: the built-in defaults)")
    p.add_argument("--world-size", type=int, default=None, help="processes (default TP x CP x PP: DP = 1)")
    p.add_argument("--vocab", type=int, default=None, help="tokenizer vocabulary (default model.vocab_size or 50304)")
    p.add_argument("--json", default=None, help="also write the numbers here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    p.add_argument("--measure", action="store_true",
                   help="also run one training step here (CPU, TP = CP = PP = 1) and print the measured peak of "
                        "the bytes it allocates next to the estimated activations + gradients")
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = p.parse_args(argv)
    if args.json:
        check_output_file(args.json, [args.config], flag="--json", overwrite=args.overwrite)
    cfg = load_config(args.config, args.overrides)
    pc = cfg.parallel
    tp, cp, pp = pc.tensor_model_parallel_size, pc.context_parallel_size, pc.pipeline_model_parallel_size
    world = args.world_size or tp * cp * pp
    validate_layout(cfg, world)
    vocab = padded_vocab_size(args.vocab or cfg.model.vocab_size or 50304, cfg.model.make_vocab_size_divisible_by, tp)
    est = estimate(cfg, vocab, world)
    mc = cfg.model
    recompute = mc.recompute_granularity or "none"
    print(f"objective {cfg.objective.name}, L = {cfg.data.seq_length}, micro-batch {cfg.train.micro_batch_size}; "
          f"layout TP={tp} CP={cp} PP={pp} DP={world // (tp * cp * pp)}, ZeRO {cfg.train.zero_stage}; "
          f"recomputation {recompute}; {est.parameters / 1e6:.1f}M parameters on the largest rank")
    for name, v in est.table():
        print(f"  {name:<20} {v / GIB:9.2f} GiB")
    print(f"  {'(activations without recomputation)':<20} {est.activations_no_recompute / GIB:9.2f} GiB")
    extra = {}
    if args.measure:
        if tp * cp * pp != 1:
            raise ValueError(f"--measure runs one process: use TP = CP = PP = 1 (got TP={tp} CP={cp} PP={pp})")
        peak, want = measure_config(cfg, vocab), est.activations + est.gradients
        extra = {"measured_step_peak": peak, "estimated_activations_and_gradients": want}
        print(f"  measured step peak {peak / GIB:.3f} GiB vs estimated activations + gradients {want / GIB:.3f} GiB "
              f"(ratio {want / peak:.2f})")
    if args.json:
        write_file_atomic(args.json, json.dumps({name: v for name, v in est.table()} | {
            "parameters": est.parameters, "activations_no_recompute": est.activations_no_recompute} | extra,
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
