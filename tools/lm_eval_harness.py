#!/usr/bin/env python
"""lm-evaluation-harness on a setdiff-mega checkpoint (native or exported); the harness's own CLI flags.

    python tools/lm_eval_harness.py --model_args checkpoint=runs/tiny_cpu,orders=1 --tasks my_task \\
        --include_path my_tasks/ --output_path results/

``--model setdiff`` is implied. Needs the optional extra: ``pip install -e '.[eval]'``.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from setdiff_mega.cli import offline_env  # noqa: E402


def main() -> int:
    offline_env()
    from setdiff_mega.eval import lm_eval_adapter

    lm_eval_adapter.make_lm_class()          # registers the "setdiff" model
    from lm_eval.__main__ import cli_evaluate

    if "--model" not in sys.argv:
        sys.argv[1:1] = ["--model", "setdiff"]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
