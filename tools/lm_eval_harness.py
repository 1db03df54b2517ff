#!/usr/bin/env python
"""lm-evaluation-harness on a setdiff-mega checkpoint (native or exported); the harness's own CLI flags.

    python tools/lm_eval_harness.py --model_args checkpoint=runs/tiny_cpu,orders=1 --tasks my_task \\
        --include_path my_tasks/ --output_path results/

    python tools/lm_eval_harness.py --model_args checkpoint=runs/tiny_cpu,preset=gsm8k,tau=0.9 --tasks gsm8k_local ...

``--model setdiff`` is implied. Decoding options go in ``--model_args`` with GenerationConfig's names
(docs/guide/decoding.md). Needs the optional extra: ``pip install -e '.[eval]'``.
"""
import sys

from setdiff_mega.cli import run_cli
from setdiff_mega.eval import lm_eval_adapter


def main(argv=None) -> int:
    lm_eval_adapter.make_lm_class()          # registers the "setdiff" model
    from lm_eval.__main__ import cli_evaluate  # gated: the optional [eval] extra, after the adapter registers

    if "--model" not in sys.argv:
        sys.argv[1:1] = ["--model", "setdiff"]
    try:
        cli_evaluate()
    except ValueError as e:                  # the harness's own user errors (unknown tasks, bad arguments)
        hint = (" (the harness lists its tasks with `lm-eval ls tasks`; tasks of your own need --include_path DIR)"
                if str(e).startswith("Tasks not found") else "")
        raise ValueError(f"lm-eval: {e}{hint}") from None
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
