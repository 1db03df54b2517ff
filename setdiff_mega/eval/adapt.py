"""The paper's AR-to-SetDLM recipe end to end at CPU scale (``tools/reproduce.py --adapt``).

The GSM8K model of the paper is a pretrained AR model (Qwen3-1.7B-Base) fine-tuned as a SetDLM on
chat-formatted worked solutions. Here, as a user with a real Qwen3 would do it:

1. **Pretrain** a small AR model with Qwen3's architecture (``QWEN3_ARCH``: RMSNorm, q / k norms, SwiGLU, tied
   embeddings, no biases) on the embedded corpus, with a tokenizer that carries a chat template
   (``CHAT_TEMPLATE``: ``User: ...`` / ``Assistant: ...`` turns; the tiny BPE has no ChatML tokens).
2. **Export** it in Qwen3's own Hugging Face layout (``to-hf --format hf``: ``Qwen3ForCausalLM``, transformers
   loads it without remote code) and fine-tune from that directory (``train.init_from=hf:DIR``: the issue-30
   import, adopting the architecture and the tokenizer with its template).
3. **Supervised data**: ``conversations`` arithmetic problems with worked solutions drawn from a stream of their
   own (none equal to a held-out problem), each a user turn (the paper's GSM8K instruction + the question) and an
   assistant turn (the worked steps, then ``The answer is $\\boxed{n}$.``), preprocessed with
   ``tools/preprocess_data.py --sft``'s code and trained packed (``data.packing``).
4. **Fine-tune** AR, MDLM, BD3LM (S = 4) and SetDLM (D = 2, 4) for ``finetune_steps`` each, from the exported
   AR model with every seed of ``seeds`` (``train.seed`` and ``data.seed``: the training noise, orders and
   masks, and the order of the conversations vary; the pretrained model is shared; an AR fine-tune has no noise,
   so its spread is the data order's) and from scratch with ``seed`` (the same architecture and
   hyperparameters),
   the diffusion models with the AR head alignment (``model.shift_logits``, method.md 13: a target reads its
   predecessor's row, so the imported head keeps its meaning).
5. **Evaluate** exact match on the held-out arithmetic problems asked as chat prompts (the last ``\\boxed{}``),
   greedy, batch 1, against tokens/s and tokens per step (tau sweep; W in {D, 2D}), and the pretrained AR on the
   plain prompt for reference; seed means and standard deviations per setting (``frontier``); the speed claim
   (SetDLM at BD3LM's best accuracy at >= 1.5x its tokens/s) on those means, for the adapted and for the
   from-scratch models; the report section (:mod:`.adapt_report`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from setdiff_mega import methods
from setdiff_mega.checkpoint import load_model
from setdiff_mega.checkpoint.families import export_model
from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.data.corpus import arith_problems, write_jsonl
from setdiff_mega.data.sft import preprocess_sft
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.inference.engine import decoding_model

from . import adapt_report as R
from . import frontier as F
from .reproduce import CPU_OVERRIDES
from .tasks import GSM8K_INSTRUCTION, load_task

QWEN3_ARCH = ["model.family=qwen3", "model.normalization=RMSNorm", "model.norm_eps=1e-6", "model.qk_layernorm=true",
              "model.activation=swiglu", "model.head_bias=false", "model.tie_embeddings=true",
              "model.rotary_base=1000000"]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
                 "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
FINETUNED = [{"objective": "ar"}, {"objective": "mdlm"}, {"objective": "bd3lm", "block_size": 4},
             {"objective": "setdlm", "D": 2}, {"objective": "setdlm", "D": 4}]
INITS = ("ar", "scratch")


@dataclass
class AdaptConfig:
    out_dir: str = "runs/reproduce/adapt"
    base_config: str = "configs/tiny_cpu.yaml"
    overrides: list = field(default_factory=lambda: list(CPU_OVERRIDES))
    pretrain_steps: int = 1600
    finetune_steps: int = 300
    finetune: list = field(default_factory=lambda: [
        "data.seq_length=256", "data.packing=true", "data.split=95,5,0", "train.micro_batch_size=8",
        "train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=20", "train.eval_interval=50",
        "train.eval_iters=4"])
    seed: int = 1234                          # pretraining, the supervised set, the from-scratch fine-tunes
    seeds: list = field(default_factory=lambda: [1234, 7, 42])    # the fine-tunes from the AR model
    conversations: int = 4000
    models: list = field(default_factory=lambda: [dict(m) for m in FINETUNED])
    taus: list = field(default_factory=lambda: [0.5, 0.9, 1e6])
    limit: int = 64                           # held-out arithmetic problems per point
    max_new_tokens: int = 48
    batch_size: int = 1
    tasks: str = "data/embedded/tasks"
    engine: str = "auto"
    data: str | None = None                   # the pretraining corpus (None: the base config's)

    def scaled(self, budget: float) -> "AdaptConfig":
        if budget != 1:
            self.pretrain_steps = max(1, round(self.pretrain_steps * budget))
            self.finetune_steps = max(1, round(self.finetune_steps * budget))
            self.limit = max(1, min(128, round(self.limit * budget)))
        return self


def chat_tokenizer(corpus_tokenizer: str | Path, out: Path) -> Path:
    """The corpus's tokenizer with :data:`CHAT_TEMPLATE` (the same vocabulary and hash), under ``out``."""
    path = out / "tokenizer" / "tokenizer.json"
    if not path.is_file():
        tok = Tokenizer.from_file(corpus_tokenizer)
        tok.chat_template = CHAT_TEMPLATE
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(path)
    return path


def conversations(n: int, seed: int, held_out: list[dict]) -> list[dict]:
    """The supervised set: chat records of arithmetic problems, none with a held-out question."""
    seen = {r["question"] for r in held_out}
    out = []
    for p in arith_problems(n + len(seen), seed + 101):
        if p["question"] in seen or len(out) == n:
            continue
        out.append({"messages": [
            {"role": "user", "content": GSM8K_INSTRUCTION + p["question"]},
            {"role": "assistant", "content": f"{p['solution']} The answer is $\\boxed{{{p['answer']}}}$."}]})
    return out


def prepare(ac: AdaptConfig, corpus_tokenizer: str, held_out: list[dict], log=print) -> tuple[Path, Path]:
    """(the chat tokenizer, the supervised dataset prefix) under ``out_dir`` (reused when present)."""
    out = Path(ac.out_dir)
    tok = chat_tokenizer(corpus_tokenizer, out)
    prefix = out / "sft" / "arith_chat"
    if not Path(f"{prefix}.idx").is_file():
        src = out / "sft" / "arith_chat.jsonl"
        src.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(conversations(ac.conversations, ac.seed, held_out), src)
        preprocess_sft([str(src)], str(prefix), str(tok), workers=2, progress=False, log=log)
    return tok, prefix


def pretrain_and_export(ac: AdaptConfig, tok: Path, log=print) -> tuple[dict, Path]:
    """Pretrain the Qwen3-architecture AR model, export it in Qwen3's layout: (its training record, export dir)."""
    data = [f"data.path={ac.data}"] if ac.data else []
    spec = {"objective": "ar", "seed": ac.seed}
    rec = F.train_model(spec, ac.pretrain_steps, Path(ac.out_dir) / "pretrain", ac.base_config,
                        [*ac.overrides, *data, *QWEN3_ARCH, f"data.tokenizer={tok}"], log)
    export = Path(ac.out_dir) / "qwen3_export"
    if not (export / "config.json").is_file() or rec.get("reused") is False:
        export_model(rec["dir"], export, overwrite=export.exists())
        log(f"exported the pretrained AR model in Qwen3's layout to {export}")
    return {**rec, "spec": spec}, export


def finetune_all(ac: AdaptConfig, tok: Path, prefix: Path, export: Path, log=print) -> list[dict]:
    """Every model of ``ac.models`` from the exported AR model and from scratch (same data, steps, settings)."""
    out = []
    for init in INITS:
        start = [f"train.init_from=hf:{export}"] if init == "ar" else QWEN3_ARCH
        for m, seed in [(m, s) for s in (ac.seeds if init == "ar" else [ac.seed]) for m in ac.models]:
            spec = {**m, "seed": seed}
            shift = [] if methods.get(m["objective"]).causal else ["model.shift_logits=true"]   # AR: shifted
            over = [*ac.overrides, *ac.finetune, "data.format=sft", f"data.path={prefix}", f"data.tokenizer={tok}",
                    f"data.seed={seed}", *start, *shift]
            rec = F.train_model(spec, ac.finetune_steps, Path(ac.out_dir) / f"from_{init}", ac.base_config, over, log)
            out.append({**rec, "spec": spec, "init": init})
    return out


def evaluate(ac: AdaptConfig, pretrained: dict, tuned: list[dict], rows: list[dict], log=print,
             progress=None) -> list[dict]:
    """Math points of every fine-tuned model (chat prompts) and of the pretrained AR model (plain prompt)."""
    points = []
    for rec in [{**pretrained, "init": "pretrained"}, *tuned]:
        model, objective, tok, cfg = load_model(rec["dir"])
        dec = (decoding_model(model, cfg, tok, ac.engine), objective, tok, cfg)
        chat = None if rec["init"] == "pretrained" else ChatRenderer.of(tok)
        for p in F.math_points(rec["spec"], dec, rows, ac.taus, ac.max_new_tokens, ac.batch_size, progress,
                               chat=chat):
            points.append({**p, "init": rec["init"], "prompt": "plain" if chat is None else "chat"})
            log(f"  {rec['init']:<10} {p['tag']:<18} W={p['window']} tau={p['tau']:g}: acc {p['accuracy']:.3f}, "
                f"{p['tokens_per_s']:.0f} tok/s, {p['tokens_per_step']:.2f} tok/step")
    return points


FRONTIER_KEYS = ("init", "method", "objective", "D", "block_size", "window", "tau")
FRONTIER_METRICS = ("accuracy", "step_accuracy", "tokens_per_s", "tokens_per_step", "forwards", "ms_per_forward")


def frontier(points: list[dict]) -> list[dict]:
    """Seed means (and standard deviations) of every setting, per initialisation."""
    return F.aggregate(points, FRONTIER_KEYS, FRONTIER_METRICS)


def speed_claims(frontier_rows: list[dict]) -> list[dict]:
    """The from-scratch reproduction's failed speed claim, on the adapted and on the from-scratch models (seed
    means)."""
    out = []
    for init in INITS:
        s = F.summarise([p for p in frontier_rows if p["init"] == init]).get("accuracy")
        if not s:
            continue
        b, f, sp = s["bd3lm_best"], s["setdlm_fastest_at_least_as_accurate"], s["speedup"]
        found = (f"SetDLM {f['tokens_per_s']:.0f} tok/s ({sp:.2f}x; {f['method']}, W={f['window']}, tau "
                 f"{f['tau']:g}; {f['tokens_per_step']:.2f} tok/step, {f['forwards']:.0f} forwards of "
                 f"{f['ms_per_forward']:.2f} ms)") if f else "no SetDLM setting reaches it"
        out.append({"claim": f"from {'the AR model' if init == 'ar' else 'scratch'}: SetDLM reaches BD3LM's best "
                             f"accuracy at >= 1.5x its tokens/s",
                    "value": f"BD3LM best {b['accuracy']:.3f} ({b['method']}, tau {b['tau']:g}) at "
                             f"{b['tokens_per_s']:.0f} tok/s ({b['tokens_per_step']:.2f} tok/step, "
                             f"{b['forwards']:.0f} forwards of {b['ms_per_forward']:.2f} ms); {found}",
                    "holds": bool(sp and sp >= 1.5), "init": init, "speedup": sp})
    return out


def run(ac: AdaptConfig, command: str, report_path: str | None, assets: str, corpus_tokenizer: str,
        log=print) -> dict:
    """Prepare, pretrain, export, fine-tune, evaluate; write ``adapt.json``, the assets and the report section."""
    t0 = time.perf_counter()
    rows = load_task(ac.tasks, "arith", ac.limit)
    tok, prefix = prepare(ac, corpus_tokenizer, load_task(ac.tasks, "arith"), log)
    pretrained, export = pretrain_and_export(ac, tok, log)
    tuned = finetune_all(ac, tok, prefix, export, log)
    t_train = time.perf_counter() - t0
    points = evaluate(ac, pretrained, tuned, rows, log)
    means = frontier(points)
    results = {"points": points, "frontier": means, "training": R.training_rows(pretrained, tuned),
               "claims": speed_claims(means)}
    wall = time.perf_counter() - t0
    trained = [pretrained, *tuned]
    results["meta"] = R.meta(ac, command, wall, t_train, sum(t["seconds"] for t in trained) + wall - t_train,
                             any(t["reused"] for t in trained))
    Path(ac.out_dir, "adapt.json").write_text(json.dumps(results, indent=1, default=str))
    files = R.write_assets(results, trained, Path(assets))
    if report_path:
        R.write_report(results, files, Path(report_path))
    return results


def toy_config(out_dir: str, data: str, tasks: str) -> AdaptConfig:
    """A seconds-sized run with the whole pipeline and report (the test suite runs it)."""
    tiny = ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "data.seq_length=128",
            "train.micro_batch_size=4", "train.eval_iters=1", "train.warmup_steps=1", "train.log_interval=2",
            "train.eval_interval=2"]
    return AdaptConfig(out_dir=out_dir, overrides=CPU_OVERRIDES + tiny, pretrain_steps=3, finetune_steps=2,
                       finetune=["data.seq_length=128", "data.packing=true", "data.split=90,10,0"], conversations=40,
                       models=[{"objective": "setdlm", "D": 2}], seeds=[1234, 7], taus=[1e6], limit=2,
                       max_new_tokens=8, tasks=tasks, data=data)


__all__ = ["AdaptConfig", "QWEN3_ARCH", "CHAT_TEMPLATE", "FINETUNED", "conversations", "run", "toy_config",
           "frontier", "speed_claims"]
