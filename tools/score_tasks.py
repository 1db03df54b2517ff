#!/usr/bin/env python
"""Score generations of a generated task with its verifier (validity, not string equality).

    python tools/prepare_data.py --task sudoku4 --knob givens=6 --out data/planning/sudoku4_g6
    python tools/generate.py --checkpoint runs/planning/sudoku4_setdlm --file data/planning/sudoku4_g6/dev.jsonl \\
        --max-new-tokens 17 --out gen_dev.jsonl
    python tools/score_tasks.py gen_dev.jsonl [--out score.json]

Each line of a generations file is ``{"request": <task record>, "text": <generated text>, ...}`` (what
tools/generate.py writes for a split file of tools/prepare_data.py --task: the request is the record, the problem
included). Prints the accuracy (the verifier's), the exact match with the reference response, and per task.
"""
import argparse
import json
import sys
from pathlib import Path

from setdiff_mega.cli import run_cli
from setdiff_mega.outputs import check_output_file, write_file_atomic
from setdiff_mega.tasks import score


def read_generations(path: str) -> list:
    pairs = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "text" not in row:
            raise ValueError(f"{path}:{lineno}: a generation record has 'request' and 'text' (tools/generate.py --out)")
        pairs.append((row.get("request"), row["text"]))
    if not pairs:
        raise ValueError(f"{path} holds no generations")
    return pairs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("generations", help="JSONL written by tools/generate.py --out")
    p.add_argument("--out", help="write the scores as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    if not Path(args.generations).is_file():
        raise FileNotFoundError(f"'{args.generations}' does not exist")
    if args.out:
        check_output_file(Path(args.out), [args.generations], flag="--out", overwrite=args.overwrite)
    result = score(read_generations(args.generations))
    print(f"{result['correct']} of {result['n']} correct: accuracy {result['accuracy']:.4f}, exact match "
          f"{result['exact_match']:.4f}")
    for name, t in result["by_task"].items():
        print(f"  {name}: {t['correct']} / {t['n']} = {t['accuracy']:.4f}")
    if args.out:
        write_file_atomic(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
