#!/usr/bin/env python
"""Print what a checkpoint holds: step, layout, config, parameter count, tensor shapes and hashes.

    python tools/inspect_checkpoint.py runs/tiny_cpu                 # newest complete checkpoint of a run
    python tools/inspect_checkpoint.py runs/tiny_cpu/checkpoints/step_0000400 --config --json out.json
    python tools/inspect_checkpoint.py exported/tiny_setdlm           # a Hugging Face export

Tensors are listed as they are stored (native: megatron-core's global tensors, layers stacked on the
first axis; Hugging Face: per-layer names). The hash is SHA-256 over the fp32 little-endian bytes,
the first 16 hex digits: equal hashes across formats or layouts mean bit-identical weights. Every
file listed in state.json is checked for presence and size first.
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import yaml
from megatron.core import dist_checkpointing

from setdiff_mega.checkpoint import hf
from setdiff_mega.checkpoint.io import CheckpointError, resolve_checkpoint
from setdiff_mega.checkpoint.native import checkpoint_config
from setdiff_mega.cli import run_cli
from setdiff_mega.config import to_dict
from setdiff_mega.outputs import check_output_file, write_file_atomic
from setdiff_mega.parallel import initialize


def tensor_hash(t) -> str:
    data = t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def native_tensors(ck: Path) -> dict:
    initialize()

    try:
        loaded = dist_checkpointing.load_plain_tensors(str(ck / "dist"))
    except Exception as e:
        raise CheckpointError(f"could not read the tensors of '{ck / 'dist'}' ({type(e).__name__}: {e})") from None
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}      # not the common (scalar) state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--config", action="store_true", help="print the full training config")
    p.add_argument("--no-tensors", action="store_true", help="skip reading tensors (state and layout only)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    args = p.parse_args(argv)
    if args.json:
        check_output_file(args.json, [args.path], flag="--json", overwrite=args.overwrite)
    path = Path(args.path)
    report = {}
    if hf.is_hf_export(path):
        cfg, tok, weights = hf.read_export(path)
        tensors = {} if args.no_tensors else dict(weights.items())
        meta = json.loads((path / "config.json").read_text())
        report.update(format="huggingface", path=str(path), step=meta.get("setdiff_mega_step"),
                      method=meta.get("method"))
    else:
        ck, state = resolve_checkpoint(path)
        cfg = checkpoint_config(ck)
        report.update(format="native", path=str(ck), step=state.get("step"), kind=state.get("kind"),
                      consumed_samples=state.get("consumed_samples"), val_loss=state.get("val_loss"),
                      optimizer=state.get("optimizer"),
                      layout={k: state.get(k) for k in ("world_size", "tensor_model_parallel_size",
                                                        "pipeline_model_parallel_size", "data_parallel_size",
                                                        "zero_stage")},
                      files=len(state.get("files", {})),
                      bytes=sum(state.get("files", {}).values()))
        tensors = {} if args.no_tensors else native_tensors(ck)
    rows = []
    weights = {k: v for k, v in tensors.items() if not k.startswith(("optimizer.", "ema."))}
    report["ema_tensors"] = sum(1 for k in tensors if k.startswith("ema."))
    for k in sorted(weights):
        t = weights[k]
        rows.append({"name": k, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                     "sha256": tensor_hash(t)})
    report["parameters"] = int(sum(t.numel() for t in weights.values()))
    report["optimizer_tensors"] = len(tensors) - len(weights) - report["ema_tensors"]
    report["objective"] = to_dict(cfg)["objective"]
    report["model"] = to_dict(cfg)["model"]
    print(f"{report['format']} checkpoint {report['path']}  step {report['step']}")
    for k in ("kind", "consumed_samples", "val_loss", "optimizer", "layout", "method"):
        if report.get(k) is not None:
            print(f"  {k}: {report[k]}")
    if not args.no_tensors:
        print(f"  parameters: {report['parameters']:,} in {len(rows)} tensors"
              + (f" (+ {report['optimizer_tensors']} optimizer tensors)" if report["optimizer_tensors"] else "")
              + (f" (+ {report['ema_tensors']} EMA tensors)" if report["ema_tensors"] else ""))
        width = max((len(r["name"]) for r in rows), default=10)
        for r in rows:
            print(f"    {r['name']:<{width}}  {str(tuple(r['shape'])):<18} {r['dtype']:<8} {r['sha256']}")
    if args.config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    report["tensors"] = rows
    if args.json:
        write_file_atomic(args.json, json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
