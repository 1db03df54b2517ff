"""The reference side of ``tools/bench_reference.py`` (issue 44): a persistent process that loads one model once
and decodes token-id prompts on request, timing each decode itself. Run as a script, by path:

    REF_VENV/bin/python reference_worker.py --release DIR --ref-dir REF_DIR    # the reference (setdlms)
    python reference_worker.py --release DIR --self                            # this project's plain engine

Standalone in reference mode: it imports the standard library and torch at the top, and the reference's own
code (``REF_DIR/src``, unmodified, put on ``sys.path``) with its pinned transformers 4.52.4 inside
:func:`reference_model`; nothing of this project. ``--self`` decodes with this project's plain engine instead
(:class:`setdiff_mega.inference.reference_bench.OursSide`, imported there), so the protocol can be tested without
the reference's environment.

The model: the DiT release in ``--release`` (``model.safetensors`` in the reference's names: ``backbone.``
vocab_embed.embedding [V, d], blocks.i.{norm1, attn_qkv [3d, d], attn_out, norm2, mlp.0, mlp.2},
output_layer.{norm_final, linear [V, d] + bias [V]}; ``config.json`` with length L, n_heads, the noise config)
loaded into the reference's ``SetDLM`` (model_type bd3lm, DIT backbone with sdpa attention, adaLN off, the
StaggeredNoise schedule of the release's D / S_max over one block of L), eval mode, fp32, one thread.

Protocol: JSON lines. The worker first writes ``{"ready": true, "side", "torch", "transformers", "threads",
"parameters", "files"}``; then for each request line ``{"prompt": [ids], "max_new_tokens": N, "window": W,
"tau": t}`` it writes ``{"tokens": [N generated ids], "seconds": wall time of the decode (prefill included),
"nfe": backbone forwards}``; ``{"quit": true}`` or end of input ends it. A bad request or a failed decode
gives ``{"error": "one line"}``.

Reference decoding options (its ``SetDiffusionGenerationConfig``, the paper scripts' generation config):
predict_and_noise, first_hitting, confidence_based_noising, confidence_threshold = tau, max_window_size = W,
block_size = L (its only supported value), greedy (do_sample false), use_cache / kv_cache true, no
stopping criteria, no logits processors, no first-hitting cache order.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

REF_FILES = ("src/denoiser/setdlm.py", "src/denoiser/mdlm.py", "src/denoiser/bd3lm.py", "src/denoiser/base.py",
             "src/backbone/dit.py", "src/denoiser/diffusion_config.py")
ALLOWED_MISSING = {"static_attention_mask", "backbone.rotary_emb.inv_freq"}   # buffers the model computes


def file_hashes(ref_dir: Path) -> dict:
    """SHA-256 (first 12 hex digits) of the reference files that decide decoding: which code was measured."""
    return {f: hashlib.sha256((ref_dir / f).read_bytes()).hexdigest()[:12] for f in REF_FILES}


def reference_model(ref_dir: Path, release: Path):
    """The reference's SetDLM holding the release's weights (see the module docstring)."""
    sys.path.insert(0, str(ref_dir))
    from safetensors.torch import load_file
    from src.denoiser.bd3lm import BD3LMConfig  # the reference's code, from REF_DIR
    from src.denoiser.setdlm import SetDLM
    from transformers import PreTrainedTokenizerFast

    raw = json.loads((release / "config.json").read_text())
    sd = load_file(str(release / "model.safetensors"))
    L, bb, noise = int(raw["length"]), raw["backbone_config"], raw["noise_config"]
    hidden = sd["backbone.vocab_embed.embedding"].shape[1]
    layers = len({k.split(".")[2] for k in sd if k.startswith("backbone.blocks.")})
    backbone = {"_target_": "src.backbone.dit.DIT", "length": L, "causal_attention": False, "adaln": False,
                "hidden_size": hidden, "cond_dim": 128, "n_heads": int(bb["n_heads"]), "num_layers": layers,
                "dropout": float(bb.get("dropout", 0.1)), "tie_word_embeddings": False,
                "vocab_size": int(raw["vocab_size"]), "block_size": L, "attn_backend": "sdpa",
                "pretrained_model_name_or_path": None}
    schedule = {"_target_": "src.noise_schedule.noise_schedules.StaggeredNoise", "block_size": L, "length": L,
                "desired_block_size": int(noise["desired_block_size"]), "max_block_size": int(noise["max_block_size"])}
    tokens = {k: raw[k] for k in ("vocab_size", "mask_token_id", "pad_token_id", "bos_token_id", "eos_token_id")}
    config = BD3LMConfig(length=L, block_size=L, eval_block_size=L, backbone_config=backbone, noise_config=schedule,
                         tokenization_config=tokens, attn_backend="sdpa")
    model = SetDLM(config, tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(release / "tokenizer.json")))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - ALLOWED_MISSING:
        raise ValueError(f"the release's tensors do not fit the reference's DIT: unexpected {unexpected[:3]}, "
                         f"missing {sorted(set(missing) - ALLOWED_MISSING)[:3]}")
    return model.eval()


class ReferenceSide:
    """Decodes with the reference's ``SetDLM.generate`` (options in the module docstring); forwards counted by a
    forward pre-hook on its backbone (the reference's code is not touched)."""

    def __init__(self, ref_dir: Path, release: Path):
        import transformers

        self.model = reference_model(ref_dir, release)
        self.L, self.calls = int(self.model.config.length), 0
        self.model.backbone.register_forward_pre_hook(self._count)
        self.info = {"side": "reference", "transformers": transformers.__version__, "files": file_hashes(ref_dir),
                     "parameters": sum(p.numel() for p in self.model.backbone.parameters())}

    def _count(self, module, args) -> None:
        self.calls += 1

    def generate(self, prompt: list, max_new_tokens: int, window: int, tau: float) -> dict:
        from src.denoiser.diffusion_config import SetDiffusionGenerationConfig

        mask = self.model.mask_token_id
        gc = SetDiffusionGenerationConfig(
            num_steps=1000, min_t=1e-5, block_size=self.L, first_hitting=True, sampling_strategy="predict_and_noise",
            noise_removal=False, confidence_based_noising=True, confidence_threshold=float(tau),
            align_inputs_to_blocks=False, nucleus_p=1.0, max_window_size=int(window), kv_cache=True,
            cache_full_infill_context=False, use_first_hitting_order_in_decode=False, do_sample=False,
            use_cache=True, pad_token_id=mask)
        inputs = torch.tensor([prompt], dtype=torch.long)
        self.calls = 0
        t0 = time.perf_counter()
        out = self.model.generate(inputs=inputs, generation_config=gc, max_new_tokens=int(max_new_tokens),
                                  device="cpu")
        dt = time.perf_counter() - t0
        seq = out[0].tolist()
        if seq[:len(prompt)] != list(prompt):
            raise ValueError("the reference's output does not start with the prompt")
        return {"tokens": seq[len(prompt):], "seconds": dt, "nfe": self.calls}


def serve(side, stdin=sys.stdin, stdout=sys.stdout) -> None:
    """The JSON-lines loop of the module docstring."""
    def say(obj) -> None:
        stdout.write(json.dumps(obj) + "\n")
        stdout.flush()

    say({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads(), **side.info})
    for line in stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("quit"):
                return
            say(side.generate(list(req["prompt"]), int(req["max_new_tokens"]), int(req["window"]), float(req["tau"])))
        except Exception as e:          # one line back to the driver, which stops with it
            say({"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="the reference side of tools/bench_reference.py (JSON lines)")
    p.add_argument("--release", required=True, help="the DiT release directory both sides load")
    p.add_argument("--ref-dir", help="a work tree of kuleshov-group/setdlms")
    p.add_argument("--self", dest="self_mode", action="store_true", help="decode with this project's plain engine")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    protocol, sys.stdout = sys.stdout, sys.stderr      # anything the libraries print goes to the log, not the protocol
    release = Path(args.release)
    if args.self_mode:
        # this project's engine (the self-test mode only: reference mode stays standalone)
        from setdiff_mega.inference.reference_bench import OursSide

        side = OursSide(release)
        side.info = {**side.info, "side": "self"}
    else:
        if not args.ref_dir:
            p.error("--ref-dir is required without --self")
        side = ReferenceSide(Path(args.ref_dir), release)
    serve(side, stdout=protocol)
    return 0


if __name__ == "__main__":
    sys.exit(main())
