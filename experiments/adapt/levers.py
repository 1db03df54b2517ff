"""The levers of the adaptation study (:mod:`.adapt`): what a fine-tune changes against the baseline recipe, where
each idea comes from, and the self-distilled data one of them trains on.

A :class:`Lever` is a fine-tuning variant: training overrides (every lever is a documented option of the stack:
``objective.ar_weight``, ``train.init_mask_row``, ``model.shift_logits``, ``train.lr``, the step count), the
supervised data (``"sft"``, the worked solutions; ``"distill"``, the AR parent's own greedy answers to the same
prompts, :mod:`.adapt_data`) and, optionally, its own step count. The study fine-tunes the lever model (SetDLM,
D = 4) once per seed with each lever, from the same exported AR parent; the baseline recipe (no lever) and the
recommended recipe (:data:`RECIPE`, the levers the measurements favour, combined) fine-tune AR, BD3LM and SetDLM
alike, so their comparisons are at equal training. Decoding levers (``commit_rule``) are sampler settings, swept
for every model (:func:`.adapt_eval.settings`).

An arm is (a lever, the models it trains); its run directories are ``<out>/arms/<hash>/models/<tag>``, the hash of
what it trains with (arms that train alike share them).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from setdiff_mega.checkpoint import load_model
from setdiff_mega.checkpoint.io import latest_checkpoint
from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.data.sft import preprocess_sft
from setdiff_mega.inference.distill import distill_records
from setdiff_mega.inference.engine import decoding_model
from setdiff_mega.inference.options import generation_config

from .data import read_jsonl, write_jsonl


@dataclass(frozen=True)
class Lever:
    name: str                                   # the arm's directory name
    label: str                                  # tables and plots
    source: str                                 # where the idea comes from
    overrides: tuple = ()                       # fine-tuning config overrides
    data: str = "sft"                           # "sft" | "distill"
    steps: int | None = None                    # None: the study's fine-tuning steps
    shift: bool = True                          # the diffusion models' AR head alignment (model.shift_logits)


BASELINE = Lever("baseline", "baseline recipe", "issue 31's recipe: 300 steps, lr 1e-3, shifted head, MASK row kept")
LEVERS = [
    Lever("ar_weight_1", "next-token loss on the clean stream, weight 1",
          "Megatron-Bridge NemotronLabsDiffusion (AR loss beside the diffusion loss), NeMo I-DLM (0.2 x clean CE)",
          ("objective.ar_weight=1.0",)),
    Lever("ar_weight_3", "next-token loss on the clean stream, weight 3",
          "NemotronLabsDiffusion's ratio (1.0 AR : 0.3 diffusion)", ("objective.ar_weight=3.0",)),
    Lever("lr_3e-3", "learning rate 3e-3 (min 3e-4)", "learning-rate sweep", ("train.lr=3e-3", "train.min_lr=3e-4")),
    Lever("lr_3e-4", "learning rate 3e-4 (min 3e-5)", "learning-rate sweep (the paper: 1e-6 at 1.7B parameters)",
          ("train.lr=3e-4", "train.min_lr=3e-5")),
    Lever("steps_600", "600 fine-tuning steps", "the paper fine-tunes for 75k steps", steps=600),
    Lever("steps_900", "900 fine-tuning steps", "the paper fine-tunes for 75k steps", steps=900),
    Lever("distill", "self-distillation (the AR parent's greedy answers)",
          "sequence-level KD (Kim & Rush 2016); the paper's GSM8K data is a teacher's answers", data="distill"),
    Lever("no_shift", "no head shift (every target reads its own row)", "the reference (no shift) vs Dream / "
          "Fast-dLLM v2's shifted head (method.md 13)", shift=False),
    Lever("mask_mean", "MASK row := mean of the other rows", "transformers' resize_token_embeddings initialisation",
          ("train.init_mask_row=mean",)),
]
RECIPE = Lever("recipe", "recommended recipe", "the levers the study favours, combined (docs/results.md)",
               steps=900)


@dataclass
class Arm:
    lever: Lever
    models: list = field(default_factory=list)     # model specs without seed


def distill_data(teacher_dir: Path, records_path: Path, out: Path, tokenizer: Path, max_new_tokens: int,
                 batch_size: int = 64, log=print) -> tuple[Path, dict]:
    """The self-distilled supervised set (:func:`setdiff_mega.inference.distill.distill_records`): the teacher's
    greedy answers to the conversations of ``records_path``, preprocessed under ``out / distill_<teacher checkpoint
    key>`` (reused when present); returns (dataset prefix, {answers, cut: answers without EOS within
    max_new_tokens})."""
    ck = latest_checkpoint(teacher_dir)
    if ck is None:
        raise FileNotFoundError(f"the distillation teacher '{teacher_dir}' holds no checkpoint")
    key = hashlib.sha256((Path(ck) / "state.json").read_bytes()).hexdigest()[:12]
    prefix, stats_f = out / f"distill_{key}", out / f"distill_{key}.stats.json"
    if Path(f"{prefix}.idx").is_file() and stats_f.is_file():
        return prefix, json.loads(stats_f.read_text())
    records = read_jsonl(records_path)
    model, objective, tok, cfg = load_model(teacher_dir)
    model = decoding_model(model, cfg, tok, "auto")
    gc = generation_config(cfg.objective, cfg.data.seq_length, None, {"max_new_tokens": max_new_tokens})
    log(f"distillation: {len(records)} answers from {teacher_dir} (greedy, batches of {batch_size})")
    distilled, stats = distill_records(model, tok, objective, records, gc, ChatRenderer.of(tok),
                                       cfg.data.seq_length, batch_size)
    stats["teacher"] = str(teacher_dir)
    src = out / f"distill_{key}.jsonl"
    write_jsonl(distilled, src)
    preprocess_sft([str(src)], str(prefix), str(tokenizer), workers=2, progress=False, log=log)
    stats_f.write_text(json.dumps(stats))
    return prefix, stats


__all__ = ["Lever", "Arm", "BASELINE", "LEVERS", "RECIPE", "distill_data"]
