#!/usr/bin/env python
"""Pretrain AR / MDLM / BD3LM / SetDLM from a YAML preset with dotted overrides (a thin wrapper of
``setdiff_mega.train``, also run as ``python -m setdiff_mega.train`` or ``setdiff-pretrain``).

    python pretrain/pretrain.py --config configs/tiny_cpu.yaml [section.field=value ...]
    python pretrain/pretrain.py --config configs/tiny_cpu.yaml objective.name=ar train.train_steps=100
"""

from setdiff_mega.train import cli

if __name__ == "__main__":
    cli()
