"""The paper's AR-to-SetDLM recipe end to end at CPU scale, and the study of what closes the gap to the AR parent
(``tools/reproduce.py --adapt``).

The GSM8K model of the paper is a pretrained AR model (Qwen3-1.7B-Base) fine-tuned as a SetDLM on
chat-formatted worked solutions. Here, as a user with a real Qwen3 would do it:

1. **Pretrain** a small AR model with Qwen3's architecture (``QWEN3_ARCH``: RMSNorm, q / k norms, SwiGLU, tied
   embeddings, no biases) on the embedded corpus, with a tokenizer that carries a chat template
   (``CHAT_TEMPLATE``: ``User: ...`` / ``Assistant: ...`` turns; the tiny BPE has no ChatML tokens).
2. **Export** it in Qwen3's own Hugging Face layout (``to-hf --format hf``: ``Qwen3ForCausalLM``, transformers
   loads it without remote code) and fine-tune from that directory (``train.init_from=hf:DIR``: the issue-30
   import, adopting the architecture and the tokenizer with its template).
3. **Supervised data** (:mod:`.data`): ``conversations`` arithmetic problems at the difficulty ``knob`` from the
   train split of :mod:`setdiff_mega.tasks.arithmetic` (held out **by computation**: no dev or test computation is
   ever drawn for training), each a user turn (the paper's GSM8K instruction + the question) and an assistant turn
   (the worked steps, then ``The answer is $\\boxed{n}$.``), preprocessed with ``tools/preprocess_data.py
   --sft``'s code and trained packed (``data.packing``); the task package's leak check runs on every set.
4. **Fine-tune** arms (:mod:`.adapt_levers`), every model of an arm once per seed of ``seeds`` (``train.seed`` and
   ``data.seed``: the training noise, orders and masks and the order of the conversations vary; the pretrained
   parent is shared; an AR fine-tune has no noise, so its spread is the data order's):

   * the baseline recipe: AR, BD3LM (S = 4) and SetDLM (D = 4) for ``finetune_steps``, the diffusion models with
     the AR head alignment (``model.shift_logits``, method.md 13);
   * one arm per lever (``levers``): the lever model (SetDLM D = 4) with that lever alone;
   * the recommended recipe (``recipe``): the levers the study favours, combined, for AR, BD3LM and SetDLM alike.

5. **Evaluate** (:mod:`.evaluate`) exact match on the ``dev_limit`` dev problems (none of whose computations is
   in the supervised set or the pretraining corpus) asked as chat prompts, greedy, in batches, for every sampler
   setting (tau x commit rule, SetDLM also W); the settings each claim needs are chosen there (:mod:`.heldout`) and
   decoded once on the ``limit`` test problems; then, with nothing else of the recipe running, the decoding speed
   at batch 1 on the first ``speed_limit`` problems of each split (tokens/s, forwards); the pretrained AR on the
   plain prompt for reference. Seed means and standard deviations per setting; the parity and speed claims on the
   test means of the dev-chosen settings (:mod:`.heldout`), the lever and tau tables on dev (:mod:`.claims`); the
   report section (:mod:`.report`).

Everything is reused on a re-run: the parent, each arm's models (their directory names carry a hash of the arm's
training options), the distilled data and every cached accuracy; only the timings are measured again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from experiments.paper import frontier as F
from experiments.paper.reproduce import CPU_OVERRIDES
from setdiff_mega import methods
from setdiff_mega.checkpoint import load_model
from setdiff_mega.checkpoint.families import export_model
from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.data.corpus import write_jsonl
from setdiff_mega.data.sft import preprocess_sft
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.eval.tasks import GSM8K_INSTRUCTION
from setdiff_mega.inference.benchmark import same_chunk as bench_same_chunk
from setdiff_mega.inference.engine import decoding_model

from . import claims as C
from . import data as D
from . import evaluate as E
from . import heldout as H
from . import report as R
from .data import problems_hash
from .levers import BASELINE, LEVERS, RECIPE, Arm, Lever, distill_data

QWEN3_ARCH = ["model.family=qwen3", "model.normalization=RMSNorm", "model.norm_eps=1e-6", "model.qk_layernorm=true",
              "model.activation=swiglu", "model.head_bias=false", "model.tie_embeddings=true",
              "model.rotary_base=1000000"]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
                 "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
FINETUNED = [{"objective": "ar"}, {"objective": "bd3lm", "block_size": 4}, {"objective": "setdlm", "D": 4}]


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
    seed: int = 1234                          # pretraining, the supervised set, the held-out problems
    seeds: list = field(default_factory=lambda: [1234, 7, 42])    # every fine-tune
    conversations: int = 4000
    models: list = field(default_factory=lambda: [dict(m) for m in FINETUNED])   # the baseline and recipe arms
    lever_model: dict = field(default_factory=lambda: {"objective": "setdlm", "D": 4})
    levers: list = field(default_factory=lambda: list(LEVERS))
    recipe: Lever | None = RECIPE
    taus: list = field(default_factory=lambda: [0.5, 0.7, 0.9, 1e6])
    rules: tuple = E.RULES
    lever_windows: tuple = (1,)               # the lever arms' W (units of D); baseline and recipe: (1, 2)
    knob: dict = field(default_factory=lambda: dict(D.KNOB))   # the arithmetic task's difficulty (.data)
    dev_limit: int = D.DEV                    # dev problems: every setting, where the settings are chosen
    limit: int = 512                          # test problems: the chosen settings, once
    speed_limit: int = 64                     # of them, decoded at batch 1 for the speed figures
    eval_batch: int = 64
    max_new_tokens: int = 48
    tasks: str = "data/embedded/tasks"
    engine: str = "auto"
    data: str | None = None                   # the pretraining corpus (None: the base config's)

    def scaled(self, budget: float) -> "AdaptConfig":
        if budget != 1:
            self.pretrain_steps = max(1, round(self.pretrain_steps * budget))
            self.finetune_steps = max(1, round(self.finetune_steps * budget))
            self.levers = [dataclasses.replace(lv, steps=max(1, round(lv.steps * budget))) if lv.steps else lv
                           for lv in self.levers]
            if self.recipe is not None and self.recipe.steps:
                self.recipe = dataclasses.replace(self.recipe, steps=max(1, round(self.recipe.steps * budget)))
            self.limit = max(8, round(self.limit * budget))
            self.dev_limit = max(8, round(self.dev_limit * budget))
            self.speed_limit = max(4, min(self.limit, round(self.speed_limit * budget)))
        return self

    def arms(self) -> list[Arm]:
        out = [Arm(BASELINE, [dict(m) for m in self.models])]
        out += [Arm(lv, [dict(self.lever_model)]) for lv in self.levers]
        if self.recipe is not None:
            out.append(Arm(self.recipe, [dict(m) for m in self.models]))
        return out

    def windows(self, arm: Arm) -> tuple:
        return (1, 2) if arm.lever.name in (BASELINE.name, getattr(self.recipe, "name", None)) else self.lever_windows


def chat_tokenizer(corpus_tokenizer: str | Path, out: Path) -> Path:
    """The corpus's tokenizer with :data:`CHAT_TEMPLATE` (the same vocabulary and hash), under ``out``."""
    path = out / "tokenizer" / "tokenizer.json"
    if not path.is_file():
        tok = Tokenizer.from_file(corpus_tokenizer)
        tok.chat_template = CHAT_TEMPLATE
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(path)
    return path


def prepare(ac: AdaptConfig, corpus_tokenizer: str, corpus_prefix: str, log=print) -> tuple[Path, Path, dict]:
    """(the chat tokenizer, the supervised dataset prefix, {"dev": rows, "test": rows, "info": counts}) under
    ``out_dir``; the dataset is reused when present, the splits are regenerated (deterministic, a second) and the
    leak check runs on both every time."""
    out = Path(ac.out_dir)
    tok = chat_tokenizer(corpus_tokenizer, out)
    prefix, src = out / "sft" / "arith_chat", out / "sft" / "arith_chat.jsonl"
    if not Path(f"{prefix}.idx").is_file():
        src.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(D.conversations(ac.conversations, ac.knob, ac.seed), src)
        preprocess_sft([str(src)], str(prefix), str(tok), workers=2, progress=False, log=log)
    corpus = D.corpus_keys(corpus_prefix)
    dev, dev_dropped = D.heldout("dev", ac.dev_limit, ac.knob, ac.seed, corpus)
    test, test_dropped = D.heldout("test", ac.limit, ac.knob, ac.seed, corpus)
    leaks = D.check(D.read_jsonl(src), dev, test)
    info = {"knob": ac.knob, "dev": len(dev), "test": len(test), "corpus_searched": corpus is not None,
            "dropped_for_corpus": {"dev": dev_dropped, "test": test_dropped}, "check": leaks}
    return tok, prefix, {"dev": dev, "test": test, "info": info}


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
    return {**rec, "spec": spec, "arm": "pretrained"}, export


def arm_dir(ac: AdaptConfig, lever: Lever) -> Path:
    """``<out>/arms/<hash of what the arm trains with>``: a changed lever trains anew, and two arms that train alike
    (the recipe's length and the length lever) share their models; ``arms.json`` there names the arms."""
    what = json.dumps([list(lever.overrides), lever.data, lever.steps or ac.finetune_steps, lever.shift,
                       ac.finetune, ac.overrides], default=str)
    d = Path(ac.out_dir) / "arms" / hashlib.sha256(what.encode()).hexdigest()[:10]
    d.mkdir(parents=True, exist_ok=True)
    names = json.loads((d / "arms.json").read_text()) if (d / "arms.json").is_file() else {}
    if names.get(lever.name) != lever.label:
        (d / "arms.json").write_text(json.dumps({**names, lever.name: lever.label}, indent=1))
    return d


def train_arm(ac: AdaptConfig, arm: Arm, tok: Path, data: dict, export: Path, log=print) -> list[dict]:
    """Every model of ``arm`` with every seed, from the exported AR model; ``data``: {"sft": prefix, "distill":
    prefix or a function building it}."""
    lv, out = arm.lever, []
    prefix = data[lv.data]() if callable(data[lv.data]) else data[lv.data]
    for seed in ac.seeds:
        for m in arm.models:
            spec = {**m, "seed": seed}
            shift = [] if methods.get(m["objective"]).causal else [f"model.shift_logits={str(lv.shift).lower()}"]
            over = [*ac.overrides, *ac.finetune, "data.format=sft", f"data.path={prefix}", f"data.tokenizer={tok}",
                    f"data.seed={seed}", f"train.init_from=hf:{export}", *shift, *lv.overrides]
            rec = F.train_model(spec, lv.steps or ac.finetune_steps, arm_dir(ac, lv), ac.base_config, over, log)
            out.append({**rec, "spec": spec, "arm": lv.name, "lever": lv.label})
    return out


def train_arms(ac: AdaptConfig, tok: Path, sft: Path, export: Path, info: dict, log=print):
    """Yield (arm, its trained models) arm by arm: the baseline first (its first AR fine-tune is the distillation
    teacher; ``info["distill"]`` gets the distilled set's counts), then the recipe (the headline a stopped and
    resumed study reaches soonest), then the levers."""
    tuned: list = []

    def distilled():
        teacher = next(t for t in tuned if t["arm"] == BASELINE.name and methods.get(t["spec"]["objective"]).causal)
        prefix, info["distill"] = distill_data(teacher["dir"], sft.with_suffix(".jsonl"), sft.parent, tok,
                                               ac.max_new_tokens, ac.eval_batch, log)
        return prefix

    arms = ac.arms()
    for arm in arms[:1] + arms[-1:] + arms[1:-1] if ac.recipe is not None else arms:
        recs = train_arm(ac, arm, tok, {"sft": sft, "distill": distilled}, export, log)
        tuned += recs
        yield arm, recs


def accuracy_all(ac: AdaptConfig, models: list[dict], rows: list[dict], split: str = "dev", chosen=None,
                 log=print) -> list[dict]:
    """Every model's accuracy points on ``split``'s ``rows`` (batched, cached): every setting, or with ``chosen``
    (:func:`.heldout.choose`) only the settings chosen for the model's arm and method; the pretrained AR on the
    plain prompt."""
    arms = {a.lever.name: a for a in ac.arms()}
    key, points = problems_hash(rows), []
    for rec in models:
        loaded = _loaded(rec["dir"], ac.engine)
        chat = None if rec["arm"] == "pretrained" else ChatRenderer.of(loaded[2])
        arm = arms.get(rec["arm"])
        every = E.settings(rec["spec"], ac.taus, ac.rules, ac.windows(arm) if arm else (1,))
        for s in every if chosen is None else H.chosen_settings(chosen, rec["arm"], F.method_label(rec["spec"])):
            a = E.accuracy_point(rec["dir"], loaded, rows, s, chat, key, ac.eval_batch, ac.engine, ac.max_new_tokens)
            p = {"arm": rec["arm"], "lever": rec.get("lever", "pretrained AR"), "dir": str(rec["dir"]),
                 "method": F.method_label(rec["spec"]), **rec["spec"], "window": s.get("window"), "tau": s["tau"],
                 "rule": s["commit_rule"], "prompt": "plain" if chat is None else "chat", "split": split, **a}
            if chosen is not None:
                p["roles"] = "+".join(H.roles_of_point(chosen, p))
            points.append(p)
            log(f"  {split:<4} {rec['arm']:<14} {p['method']:<14} s{p['seed']:<5} W={p['window']} tau={p['tau']:g} "
                f"{p['rule']:<10}: acc {a['accuracy']:.3f}, {a['tokens_per_step']:.2f} tok/step")
    return points


def speed_all(ac: AdaptConfig, points: list[dict], rows: list[dict], log=print) -> None:
    """Batch-1 timings of every point (in place), model by model, after all training and accuracy work (a model
    and setting two arms share is timed once)."""
    by_dir: dict = {}
    for p in points:
        by_dir.setdefault(p["dir"], []).append(p)
    sub = rows[:ac.speed_limit]
    for d, pts in by_dir.items():
        loaded = _loaded(d, ac.engine)
        chat = None if pts[0]["prompt"] == "plain" else ChatRenderer.of(loaded[2])
        done: dict = {}
        first = {"tau": pts[0]["tau"], "commit_rule": pts[0]["rule"],
                 **({"window": pts[0]["window"]} if pts[0]["window"] else {})}
        E.speed_point(loaded, sub[:2], first, chat, [], ac.max_new_tokens)        # warm-up, untimed
        for p in pts:
            s = {"tau": p["tau"], "commit_rule": p["rule"], **({"window": p["window"]} if p["window"] else {})}
            key = json.dumps(s, sort_keys=True)
            if key not in done:
                done[key] = E.speed_point(loaded, sub, s, chat, p["texts"][:len(sub)], ac.max_new_tokens)
            p.update(done[key])
        log(f"  timed {pts[0]['method']} s{pts[0]['seed']} ({d}): "
            + ", ".join(f"{v['tokens_per_s']:.0f}" for v in done.values()) + " tok/s")


def same_chunk(ac: AdaptConfig, tuned: list[dict], rows: list[dict]) -> dict | None:
    """SetDLM's and BD3LM's decode step on the baseline SetDLM of the first seed, at the same chunk (W = S = D, tau
    0: D pending + D query rows; :func:`setdiff_mega.inference.benchmark.same_chunk`), on chat prompts."""
    rec = next((t for t in tuned if t["arm"] == BASELINE.name and t["spec"]["objective"] == ac.lever_model["objective"]
                and t["spec"]["seed"] == ac.seeds[0]), None)
    if rec is None:
        return None
    model, _, tok, _ = _loaded(rec["dir"], ac.engine)
    chat = ChatRenderer.of(tok)
    prompts = [{"input_ids": chat.prompt_ids(GSM8K_INSTRUCTION + r["question"])} for r in rows[:8]]
    size = int(ac.lever_model.get("D", 4))
    out = bench_same_chunk(model, tok, prompts, size, (ac.max_new_tokens // size) * size)
    return {**out, "setdlm_over_bd3lm": out["setdlm"]["step_ms"] / out["bd3lm"]["step_ms"], "size": size,
            "model": F.method_label(rec["spec"]), "seed": rec["spec"]["seed"]}


def _loaded(run_dir, engine: str) -> tuple:
    model, objective, tok, cfg = load_model(run_dir)
    return decoding_model(model, cfg, tok, engine), objective, tok, cfg


KEYS = ("arm", "lever", "method", "objective", "D", "block_size", "window", "tau", "rule", "prompt")
METRICS = ("accuracy", "step_accuracy", "tokens_per_s", "tokens_per_step", "forwards", "ms_per_forward",
           "rows_per_forward", "agreement")


def frontier(points: list[dict]) -> list[dict]:
    """Seed means (and standard deviations) of every setting of every arm."""
    return F.aggregate(points, KEYS, METRICS)


def run(ac: AdaptConfig, command: str, report_path: str | None, assets: str, corpus_tokenizer: str,
        corpus_prefix: str, log=print, timings: bool = True) -> dict | None:
    """Prepare, pretrain, export, fine-tune the arms, evaluate, time; write ``adapt.json``, the assets and the
    report section. ``timings=False`` stops after the (cached) accuracies: the long part, which may share the
    machine; a later run with timings reuses all of it."""
    t0 = time.perf_counter()
    tok, sft, split = prepare(ac, corpus_tokenizer, corpus_prefix, log)
    dev, test = split["dev"], split["test"]
    pretrained, export = pretrain_and_export(ac, tok, log)
    points, tuned, info = accuracy_all(ac, [pretrained], dev, log=log), [], {}
    for _, recs in train_arms(ac, tok, sft, export, info, log):      # each arm evaluated once it is trained
        tuned += recs
        points += accuracy_all(ac, recs, dev, log=log)
    dev_means = F.aggregate(points, KEYS, ("accuracy", "tokens_per_step"))      # deterministic: no timing decides
    chosen = H.choose([p for p in dev_means if p["arm"] != "pretrained"])
    test_points = accuracy_all(ac, [pretrained], test, "test", log=log) + \
        accuracy_all(ac, tuned, test, "test", chosen, log)
    t_train = time.perf_counter() - t0
    if not timings:
        return None
    t_acc = time.perf_counter()
    speed_all(ac, points, dev, log)
    speed_all(ac, test_points, test, log)
    same = same_chunk(ac, tuned, test)
    t_speed = time.perf_counter() - t_acc
    results = summarise(ac, points, test_points, chosen, pretrained, tuned, info, split["info"], same)
    wall = time.perf_counter() - t0
    trained = [pretrained, *tuned]
    results["meta"] = R.meta(ac, command, wall, t_train, sum(t["seconds"] for t in trained) + wall - t_train,
                             any(t["reused"] for t in trained), t_speed)
    Path(ac.out_dir, "adapt.json").write_text(json.dumps(results, indent=1, default=str))
    files = R.write_assets(results, trained, Path(assets))
    if report_path:
        R.write_report(results, files, Path(report_path))
    return results


def summarise(ac: AdaptConfig, points, test_points, chosen, pretrained, tuned, info, held, same) -> dict:
    """The results record: dev points and means (every setting), test points and means (the chosen ones), the
    claims (parity and speed on test, the tau collapse on dev), the lever rows and the resolution (dev)."""
    for p in points + test_points:
        p.pop("texts", None)
        p.pop("correct", None)
    means = frontier(points)
    test_means = F.aggregate(test_points, (*KEYS, "roles"), METRICS)
    training = R.training_rows(pretrained, tuned)
    collapse = [c for c in C.claims(means, ac) if c["arm"] == "all"]
    return {"points": points, "frontier": means, "test_points": test_points, "test_frontier": test_means,
            "chosen": chosen, "training": training, "claims": H.test_claims(test_means, ac) + collapse,
            "levers": C.lever_rows(means, points, ac, training), "resolution": C.design_resolution(means, points, ac),
            "test_resolution": C.design_resolution(test_means, test_points, ac), "distill": info.get("distill"),
            "held_out": {**held, "n": held["test"]}, "same_chunk": same}


def toy_config(out_dir: str, data: str, tasks: str) -> AdaptConfig:
    """A seconds-sized run with the whole pipeline and report (the test suite runs it): the baseline arm (AR and
    SetDLM, two seeds) and one lever arm that trains on the distilled data with the next-token loss."""
    tiny = ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "data.seq_length=128",
            "train.micro_batch_size=4", "train.eval_iters=1", "train.warmup_steps=1", "train.log_interval=2",
            "train.eval_interval=2"]
    lever = Lever("distill_ar", "self-distillation + next-token loss", "the toy run", ("objective.ar_weight=1.0",),
                  data="distill", steps=3)
    return AdaptConfig(out_dir=out_dir, overrides=CPU_OVERRIDES + tiny, pretrain_steps=3, finetune_steps=2,
                       finetune=["data.seq_length=128", "data.packing=true", "data.split=90,10,0"], conversations=40,
                       models=[{"objective": "ar"}, {"objective": "setdlm", "D": 2}],
                       lever_model={"objective": "setdlm", "D": 2}, levers=[lever], recipe=None, seeds=[1234, 7],
                       taus=[0.9, 1e6], limit=6, dev_limit=6, speed_limit=3, eval_batch=4, max_new_tokens=8,
                       tasks=tasks, data=data, knob={"steps": 1, "max_value": 20})   # prompts within L = 128


__all__ = ["AdaptConfig", "QWEN3_ARCH", "CHAT_TEMPLATE", "FINETUNED", "run", "toy_config",
           "frontier", "prepare", "summarise", "arm_dir"]
