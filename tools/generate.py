#!/usr/bin/env python
"""Generate from a trained checkpoint with the sampler of its objective (SetDLM, AR, BD3LM, MDLM).

    python tools/generate.py --checkpoint runs/tiny_cpu --prompt "Question: ..." --tau 0.9 --window 4
    python tools/generate.py --checkpoint runs/tiny_cpu --infill-prefix "A." --infill-suffix "C." --span 12
    python tools/generate.py --checkpoint runs/tiny_cpu --file prompts.jsonl --out results.jsonl
    echo "Once upon" | python tools/generate.py --checkpoint runs/tiny_cpu --file -
    python tools/generate.py --checkpoint runs/tiny_cpu --demo data/embedded/tasks    # the demo's samples
    python tools/generate.py --checkpoint exported/tiny_setdlm --prompt "Once"   # a Hugging Face export
    python tools/generate.py --checkpoint runs/tiny_cpu --prompt "" --preset owt --max-new-tokens 300
    python tools/generate.py --checkpoint runs/ar_chat --distill sft.jsonl --out distilled.jsonl   # self-distill

--checkpoint takes a native checkpoint (run, checkpoints/ or step directory) or a directory written by
``tools/convert_checkpoint.py to-hf``; the sampler is rebuilt from the method recorded in either.

Prompts: --prompt (repeatable), --file (.txt: one prompt per line; .jsonl: {"prompt": ...} or
{"prefix", "suffix", "span"} per line; '-' reads lines from stdin). A prompt may contain <|mask|>
tokens to infill. Output: text on stdout, or JSONL (--out) with text, tokens/s, NFE, tokens/step.

Decoding flags (setdiff_mega/inference/options.py; docs/guide/decoding.md gives the reference's names):
--preset gsm8k|cnndm|owt|infill applies the paper's protocol for that evaluation, explicit flags win.
With --demo the unconditional sample follows the OWT protocol (BOS prompt, nucleus 0.95, repetition
penalty 1.05, one token per step, no EOS / low-confidence stop before max_new_tokens / 3 tokens).

--distill SFT.jsonl (with --out): sequence-level self-distillation data. Every supervised record keeps its
conversation up to its last assistant turn, which becomes this model's answer to it (chat template, decoding
flags as given, greedy by default); the output is a supervised file for tools/preprocess_data.py --sft
(setdiff_mega/inference/distill.py; the adaptation recipe's "distill" lever).
"""
import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from setdiff_mega.checkpoint import load_model
from setdiff_mega.cli import run_cli
from setdiff_mega.inference import RequestError, encode_request, generate
from setdiff_mega.inference.engine import decoding_model
from setdiff_mega.inference.options import (
    add_chat_arguments,
    add_generation_arguments,
    chat_from_args,
    config_from_args,
    generation_config,
)
from setdiff_mega.outputs import check_output_file, write_file_atomic


def demo_requests(task_dir: str, tok) -> tuple[list, list]:
    """Unconditional, the first held-out math question and the first held-out story with its middle
    sentence masked (oracle span length), with the references to print next to the samples."""
    root = Path(task_dir)
    if not (root / "math.jsonl").is_file():
        raise FileNotFoundError(f"'{root}/math.jsonl' does not exist; run tools/prepare_data.py --embedded first")
    math = json.loads((root / "math.jsonl").read_text().splitlines()[0])
    story = json.loads((root / "stories.jsonl").read_text().splitlines()[0])
    s = story["sentences"]
    prefix, middle, suffix = " ".join(s[:2]), " " + s[2], " " + " ".join(s[3:])
    reqs = ["", f"Question: {math['question']}\nAnswer:",
            {"prefix": prefix, "suffix": suffix, "span": len(tok.encode(middle))}]
    refs = [None, f"#### {math['answer']}", middle.strip()]
    return reqs, refs


def fitting(requests: list, refs: list, tok, context: int) -> tuple[list, list]:
    """The demo requests whose visible tokens fit the model's context (the others are reported)."""
    keep = []
    for req, ref in zip(requests, refs):
        try:
            encode_request(tok, req, context=context)
            keep.append((req, ref))
        except RequestError as e:
            print(f"(demo request skipped: {e})", file=sys.stderr)
    return [r for r, _ in keep], [f for _, f in keep]


def read_requests(args) -> list:
    reqs: list = list(args.prompt or [])
    if args.infill_prefix is not None or args.infill_suffix is not None:
        reqs.append({"prefix": args.infill_prefix or "", "suffix": args.infill_suffix or "", "span": args.span})
    if args.file:
        src = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
        jsonl = args.file.endswith(".jsonl")
        for lineno, line in enumerate(src, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if jsonl:
                try:
                    reqs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{args.file}:{lineno}: not valid JSON ({e.msg})") from None
            else:
                reqs.append(line.replace("\\n", "\n"))
    if not reqs:
        raise ValueError("no prompts: pass --prompt, --file or --infill-prefix/--infill-suffix")
    return reqs


def demo_unconditional_config(objective_cfg, seq_length: int, args):
    """The reference's OWT protocol (BOS prompt, nucleus 0.95, repetition 1.05, one token per step, EOS and
    low-confidence stops only after a minimum length) scaled to the demo: min_new_tokens = max_new_tokens / 3
    (the reference: 128 of 1023)."""
    n = args.max_new_tokens or args._max_new_tokens_default
    return generation_config(objective_cfg, seq_length, "owt", {"max_new_tokens": n, "min_new_tokens": n // 3,
                                                                 "seed": args.seed or 0})


def distill(args, model, objective, tok, cfg) -> int:
    """--distill: the records of ``args.distill`` answered by the model, to ``args.out``."""
    from setdiff_mega.data.chat import ChatRenderer
    from setdiff_mega.inference.distill import distill_records

    src = Path(args.distill)
    if not src.is_file():
        raise FileNotFoundError(f"--distill '{src}' does not exist")
    records = []
    for lineno, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{src}:{lineno}: not valid JSON ({e.msg})") from None
    bar = tqdm(total=len(records), desc="distill", unit="rec", file=sys.stderr)
    out, stats = distill_records(model, tok, objective, records, config_from_args(args, cfg.objective,
                                 cfg.data.seq_length), ChatRenderer.of(tok, args.chat_template_kwargs),
                                 cfg.data.seq_length, args.batch_size, progress=bar.update)
    bar.close()
    write_file_atomic(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    print(f"wrote {stats['answers']} distilled records to {args.out} ({stats['cut']} cut at --max-new-tokens)",
          file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="run directory, checkpoints/ directory, step directory or Hugging Face export")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--file", help="prompts file (.txt / .jsonl) or '-' for stdin")
    p.add_argument("--demo", metavar="TASK_DIR", help="three demo requests (unconditional, math, infill) "
                   "from the held-out tasks of an embedded dataset, e.g. data/embedded/tasks")
    p.add_argument("--infill-prefix")
    p.add_argument("--infill-suffix")
    p.add_argument("--span", type=int, default=16, help="infill span length in tokens")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", help="write JSONL here instead of printing")
    p.add_argument("--distill", metavar="SFT_JSONL", help="answer the last assistant turn of every supervised record "
                   "with this model and write the records to --out (self-distillation data)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--weights", choices=("ema", "raw"), default=None,
                   help="the EMA of a train.ema_decay run or the raw weights (default: the EMA when present)")
    add_chat_arguments(p)
    add_generation_arguments(p)
    args = p.parse_args(argv)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1 (got {args.batch_size})")
    if args.distill and not args.out:
        raise ValueError("--distill writes supervised records: give --out FILE.jsonl")
    if args.out:
        check_output_file(args.out, [args.checkpoint, args.file, args.demo, args.distill], flag="--out",
                          overwrite=args.overwrite)

    model, objective, tok, cfg = load_model(args.checkpoint, weights=args.weights)
    model = decoding_model(model, cfg, tok, args.engine, args.decode_weights)
    L = cfg.data.seq_length
    if args.distill:
        return distill(args, model, objective, tok, cfg)
    refs = None
    if args.demo:
        requests, refs = fitting(*demo_requests(args.demo, tok), tok, L)
    else:
        requests = read_requests(args)
    gc = config_from_args(args, cfg.objective, L)
    chat = chat_from_args(tok, args)
    bar = tqdm(total=len(requests), desc="generate", unit="req", file=sys.stderr,
               disable=len(requests) <= args.batch_size)
    if args.demo:              # the unconditional sample follows the reference's OWT protocol
        results = generate(model, tok, objective, requests[:1], demo_unconditional_config(cfg.objective, L, args),
                           context=L, batch_size=1, progress=bar.update)
        if requests[1:]:
            results += generate(model, tok, objective, requests[1:], gc, context=L, batch_size=args.batch_size,
                                progress=bar.update)
    else:
        results = generate(model, tok, objective, requests, gc, context=L, batch_size=args.batch_size,
                           progress=bar.update, chat=chat)
    bar.close()
    if args.out:
        write_file_atomic(args.out, "".join(json.dumps({"request": req, **r}, ensure_ascii=False) + "\n"
                                            for req, r in zip(requests, results)))
        tps = sum(r["num_tokens"] for r in results) / max(sum({r["seconds"] for r in results}), 1e-9)
        print(f"wrote {len(results)} results to {args.out} ({tps:.1f} tokens/s)", file=sys.stderr)
    else:
        for i, r in enumerate(results):
            kind = "infill" if r["infill"] else ("unconditional" if requests[i] == "" else "prompt")
            print(f"--- [{objective.name}, {kind}] {r['num_tokens']} tokens in {r['steps']} steps "
                  f"({r['tokens_per_step']:.2f} tokens/step), {r['tokens_per_s']:.1f} tok/s, "
                  f"NFE {r['nfe']} (batch of {min(args.batch_size, len(results))})")
            print(r["sequence"] if kind != "unconditional" else r["text"])
            if refs and refs[i]:
                print(f"    (reference: {refs[i]})")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
