#!/usr/bin/env python
"""Side-by-side decoding against the reference implementation (issue 44; not a test).

    scripts/setup_reference.sh REF_DIR                       # once: the reference's own venv (.venv-ref)
    python tools/bench_reference.py --ref-dir REF_DIR [--ref-venv .venv-ref] [--shape gpt2|main|L,H,heads,V,L,D]
        [--taus 1e6,0.9] [--windows 8] [--rounds 3] [--out-dir runs/bench_reference]

This project's plain engine and the reference's SetDLM.generate (kuleshov-group/setdlms, unmodified, in its own
venv with transformers 4.52.4) decode the same random-weight DiT (GPT-2-small shape by default; written once
into OUT/release-<digest>) and the same token-id prompts, batch 1, one thread each, greedy, KV cache, window W,
threshold tau;
rounds interleaved (ours, reference, reference, ours, ...). Reports per setting the median tokens/s and ms per
forward of each side, their ratios (ours / reference) and the fraction of identical generated tokens; at tau < 1
also ``ours_reference_k``, this engine with the reference's forced-commit schedule (see
setdiff_mega/inference/reference_bench.py). Writes OUT/reference.json and OUT/reference.txt (the table);
the reference worker's log is OUT/worker.log. ``--self`` replaces the reference by this project's engine in the
worker process (a check of the harness, no reference needed).
"""
import argparse
import sys

from tqdm import tqdm

from setdiff_mega.cli import run_cli
from setdiff_mega.hfmodel.linears import FORMATS
from setdiff_mega.inference import reference_bench
from setdiff_mega.outputs import claim_output_dir, either, holds_only, marked_by

TOOL = "bench_reference"
REPORTS = (".json", ".txt", ".log", ".safetensors")        # what an --out-dir of this tool holds


def _floats(s: str) -> tuple:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _formats(s: str) -> tuple:
    out = tuple(x.strip() for x in s.split(",") if x.strip())
    bad = [x for x in out if x not in FORMATS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"unknown format(s) {bad}; choose among {', '.join(FORMATS)}")
    return out


def _ints(s: str) -> tuple:
    return tuple(int(x) for x in s.split(",") if x.strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref-dir", help="a work tree of kuleshov-group/setdlms (scripts/setup_reference.sh)")
    p.add_argument("--ref-venv", default=".venv-ref", help="the reference's venv (scripts/setup_reference.sh)")
    p.add_argument("--self", dest="self_test", action="store_true",
                   help="the worker decodes with this project's engine (checks the harness; no reference needed)")
    p.add_argument("--shape", default="gpt2", help="gpt2 (12 x 768, 12 heads, V 50258, L 1024), main (the main "
                   "job's model: --main-config, the embedded tokenizer's V 2048) or LAYERS,HIDDEN,HEADS,VOCAB,L,D")
    p.add_argument("--main-config", default="configs/tiny_cpu.yaml", help="the config --shape main reads")
    p.add_argument("--taus", type=_floats, default=(1e6, 0.9), help="comma-separated thresholds")
    p.add_argument("--windows", type=_ints, default=(8,), help="comma-separated windows W")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="the weights' and prompts' seed")
    p.add_argument("--logit-std", type=float, default=8.0,
                   help="the head's scale: logits ~ N(0, s^2), so some confidences pass tau 0.9")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    p.add_argument("--decode-weights", type=_formats, default=("fp32",),
                   help="comma-separated formats of this side's plain forward, each its own runner (the first is "
                        "'ours'; fp32: exact, the tokens comparable), e.g. fp32,fp32-packed,bf16")
    p.add_argument("--out-dir", default="runs/bench_reference")
    args = p.parse_args(argv)

    shape = reference_bench.parse_shape(args.shape, args.main_config)
    reference_bench.check_options(shape, args.taus, args.windows, args.rounds, args.num_prompts, args.prompt_length,
                                  args.max_new_tokens)
    inputs = []
    if not args.self_test:
        reference_bench.check_reference(args.ref_dir, args.ref_venv)
        inputs = [args.ref_dir, args.ref_venv]
    out = claim_output_dir(args.out_dir, inputs, flag="--out-dir", tool=TOOL, continues=True,
                           owned=either(marked_by(TOOL), holds_only(*REPORTS)))
    k = len(args.decode_weights)
    runners = (1 + k) * len(args.taus) + k * sum(t < 1 for t in args.taus)
    with tqdm(total=args.rounds * runners * len(args.windows), desc="decode passes", file=sys.stderr) as bar:
        report = reference_bench.run(
            out, shape, ref_dir=args.ref_dir, ref_venv=args.ref_venv, self_test=args.self_test, taus=args.taus,
            windows=args.windows, rounds=args.rounds, num_prompts=args.num_prompts, prompt_length=args.prompt_length,
            max_new_tokens=args.max_new_tokens, seed=args.seed, logit_std=args.logit_std, threads=args.threads,
            decode_weights=args.decode_weights, say=lambda s: tqdm.write(s, file=sys.stderr),
            tick=lambda name: bar.update(1))
    print(reference_bench.table(report))
    print(f"wrote {out / 'reference.json'} and {out / 'reference.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
