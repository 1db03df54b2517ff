"""The conversion study's models: the parent imported once, and every child fine-tuned from it in a subprocess.

* :func:`import_parent`: the parent (a GGUF file, ``pkg:PACKAGE/PATH``, or a Hugging Face directory: the toy) as
  a native AR checkpoint under ``<out>/parent/<sha256 of the input, 16 hex>``, by ``tools/convert_checkpoint.py
  from-gguf`` (``from-hf`` for a directory) run as a subprocess; reused while that directory holds a checkpoint.
  Every tensor of the GGUF file is dequantised to fp32: the parent **is** the dequantised model.
* :func:`train_child`: one (arm, task, knob, seed) fine-tune, ``python -m setdiff_mega.train`` (what
  ``pretrain/pretrain.py`` wraps) as a subprocess (``experiments.paper.frontier.train_model``) with the config
  file, ``train.init_from`` = the parent (its architecture adopted), the objective of the arm's method, the head
  shift (``model.shift_logits=true``) for every method that is not causal, the task's data and length, the seed
  (``train.seed`` and ``data.seed``) and the recipe's overrides. The run directory is
  ``<out>/models/<task>/<knob>/<method>/<recipe>/<run id>/models/<method tag>_s<seed>``, the run id
  (:func:`run_id`) a hash of everything it trains with, so a changed recipe trains anew; a killed run resumes from
  its last checkpoint (``train.resume=auto``, saves every ``train.save_interval`` steps) when it is run again.
* :func:`write_toy_parent`: a tiny random Llama (2 layers, hidden 32) with a byte-level BPE tokenizer and a ChatML
  template, saved as a Hugging Face directory: the ``--toy`` study's parent.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from experiments.paper import frontier as F
from setdiff_mega import package_files
from setdiff_mega.checkpoint.io import latest_checkpoint
from setdiff_mega.tasks import knob_tag

from .plan import Arm, ConvertConfig, TaskPlan, kind
from .points import code_fingerprints

ROOT = Path(__file__).resolve().parents[2]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def source_sha(source: str) -> str:
    """sha256 of the parent's input: the file, or a directory's files in name order."""
    p = package_files.resolve(source)
    if not p.exists():
        raise FileNotFoundError(f"parent '{source}' does not exist (the GGUF file is installed by scripts/setup.sh; "
                                f"or name a .gguf file / a Hugging Face directory)")
    h = hashlib.sha256()
    for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
        if f.is_file():
            h.update(f.relative_to(p).as_posix().encode() if p.is_dir() else b"")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
    return h.hexdigest()


def file_sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def import_parent(cc: ConvertConfig, log=print) -> tuple[Path, str]:
    """(the parent's run directory, the input's sha256): imported once, reused while present (module docstring)."""
    sha = source_sha(cc.parent)
    out = Path(cc.out_dir) / "parent" / sha[:16]
    if latest_checkpoint(out) is not None:
        return out, sha
    src = package_files.resolve(cc.parent)
    how = "from-hf" if src.is_dir() else "from-gguf"
    log(f"importing the parent {cc.parent} ({how}{', every tensor dequantised to fp32' if how == 'from-gguf' else ''})"
        f" -> {out}")
    cmd = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), how, str(cc.parent), str(out),
           "--objective", "ar", "--import-dtype", "fp32", "--overwrite", f"data.seq_length={max_length(cc)}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{sha[:16]}.log", "a") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise RuntimeError(f"importing the parent failed (exit {p.returncode}); see {out.parent / f'{sha[:16]}.log'}")
    return out, sha


def max_length(cc: ConvertConfig) -> int:
    return max((t.seq_length for t in cc.tasks), default=256)


def parent_tokenizer(parent: Path) -> Path:
    ck = latest_checkpoint(parent)
    if ck is None:
        raise FileNotFoundError(f"'{parent}' holds no checkpoint: import the parent first")
    return Path(ck) / "tokenizer.json"


def overrides(cc: ConvertConfig, arm: Arm, tp: TaskPlan, data_dir: Path, parent: Path, seed: int) -> list[str]:
    """The training overrides of one child (module docstring), without the method's own (frontier adds them)."""
    shift = [] if kind(arm.method) == "causal" else ["model.shift_logits=true"]
    return [f"train.init_from={parent}", f"data.path={Path(data_dir) / 'corpus'}",
            f"data.tokenizer={Path(data_dir) / 'tokenizer.json'}", f"data.seq_length={tp.seq_length}",
            f"data.seed={seed}", *shift, *arm.recipe.overrides, *cc.overrides]


def run_id(cc: ConvertConfig, arm: Arm, tp: TaskPlan, knob: dict, parent_sha: str) -> str:
    """A hash of what a child trains with but its seed: the config file, the parent, the method, the task, knob,
    sizes and steps, the recipe's and the study's overrides, and the training code's fingerprint (new code trains
    a new child: an old run directory is never reused under a fingerprint it was not trained with)."""
    what = [file_sha(cc.config), parent_sha, arm.method, tp.task, knob, tp.seq_length, tp.steps, tp.num_train,
            cc.data_seed, list(arm.recipe.overrides), list(cc.overrides), code_fingerprints()["train"]]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _where(cc: ConvertConfig, arm: Arm, tp: TaskPlan, knob: dict, parent_sha: str) -> Path:
    return Path(cc.out_dir) / "models" / tp.task / knob_tag(knob) / arm.name / run_id(cc, arm, tp, knob, parent_sha)


def child_dir(cc: ConvertConfig, arm: Arm, tp: TaskPlan, knob: dict, seed: int, parent_sha: str) -> Path:
    """The run directory of one child (module docstring)."""
    return _where(cc, arm, tp, knob, parent_sha) / "models" / F.method_tag({**arm.method, "seed": seed})


def trained(run_dir: Path, steps: int) -> bool:
    """Whether ``run_dir`` holds a finished run of ``steps`` steps (what frontier.train_model reuses)."""
    s = Path(run_dir) / "summary.json"
    try:
        return json.loads(s.read_text()).get("final_step") == steps and (Path(run_dir) / "train_time.json").is_file()
    except (OSError, ValueError):
        return False


def train_child(cc: ConvertConfig, arm: Arm, tp: TaskPlan, knob: dict, seed: int, data_dir: Path, parent: Path,
                parent_sha: str, log=print) -> dict:
    """Train (or reuse) one child; returns {dir, seconds, reused, run_id, value} (value: the training point)."""
    rid = run_id(cc, arm, tp, knob, parent_sha)
    spec = {**arm.method, "seed": seed}
    rec = F.train_model(spec, tp.steps, _where(cc, arm, tp, knob, parent_sha), cc.config,
                        overrides(cc, arm, tp, data_dir, parent, seed), log)
    s = json.loads((Path(rec["dir"]) / "summary.json").read_text())
    value = {"final_val_loss": s.get("final_val_loss"), "final_step": s.get("final_step"),
             "parameters": s.get("num_parameters"), "train_seconds": round(rec["seconds"], 1), "steps": tp.steps}
    return {**rec, "run_id": rid, "value": value}


def write_toy_parent(out: str | Path, vocab: int = 384) -> Path:
    """A tiny random Llama with a ChatML tokenizer as a Hugging Face directory (module docstring)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    text = [f"What is {a} * {b}? Answer with the number only. {a * b}" for a in range(10, 100, 7)
            for b in range(10, 100, 11)] + ["user assistant system the number only answer step by step"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=vocab - 16, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}))
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(out))
    return out


__all__ = ["import_parent", "parent_tokenizer", "train_child", "child_dir", "trained", "run_id", "overrides",
           "source_sha", "file_sha", "write_toy_parent", "CHATML"]
