"""The embedded tasks: math exact match and story infilling, decoded with a model's own sampler.

* math (``tasks/math.jsonl``): prompt ``"Question: {question}\\nAnswer:"``; the answer is the content of the
  last ``\\boxed{...}`` of the generation, else the number after its last ``####``, else its last number; exact
  match against ``answer``. With a chat renderer (a model fine-tuned on conversations) the prompt is instead the
  reference's GSM8K user turn, :data:`GSM8K_INSTRUCTION` + question, rendered with the chat template and its
  generation prompt (method.md 7: the paper's GSM8K evaluation).
  ``step_accuracy``: the fraction of the generated arithmetic steps ``a op b = c`` that are correct;
  ``copy_accuracy``: the fraction of solutions whose first number is the question's first number (the
  worked solution starts from it: copying it is the first thing the task asks of a model).
* arith (``tasks/arith.jsonl``): the learnable math level, scored like math.
* stories (``tasks/stories.jsonl``): the middle sentence of a five-sentence story is masked with its
  true token length (oracle span, as in the paper's infilling evaluation); exact match and ROUGE-L F1
  of the infilled sentence. ``left_only`` gives the sampler only the prefix (what an AR model can use)
  and decodes the same number of tokens, for the infilling comparison.
* quests (``tasks/quests.jsonl``): the suffix-dependent task (infill-3 layout): sentences 2-4 masked,
  sentence 1 left, sentence 5 (which alone names the goal) right; scored the same way.

Examples that do not fit the model's context are skipped and counted (``skipped_too_long``). Every
task result also reports tokens/s, NFE (model calls) and tokens per step of the decoding.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from setdiff_mega.inference import generate

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
GSM8K_INSTRUCTION = "Please reason step by step, and put your final answer within $\\boxed{}$. "


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The last ``\\boxed{}``'s number (the GSM8K protocol), else the number after the last '####', else the
    last number in the text; commas removed."""
    boxed = last_boxed(text)
    if boxed is not None:
        nums = _NUM.findall(boxed)
        return nums[-1].replace(",", "").rstrip(".") if nums else None
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    nums = _NUM.findall(tail)
    if not nums:
        return None
    return (nums[0] if "####" in text else nums[-1]).replace(",", "").rstrip(".")


_EQ = re.compile(r"(-?\d+)\s*([-+*x])\s*(-?\d+)\s*=\s*(-?\d+)")


def equation_counts(text: str) -> tuple[int, int]:
    """(correct, total) arithmetic steps ``a op b = c`` in a generated solution: partial credit that
    separates models too small to get whole answers right."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "x": lambda a, b: a * b}
    eqs = _EQ.findall(text)
    return sum(ops[o](int(a), int(b)) == int(c) for a, o, b, c in eqs), len(eqs)


def _first_number(text: str) -> str | None:
    m = _NUM.search(text)
    return m.group(0) if m else None


def _lcs(a: list, b: list) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F1 over lower-cased word tokens."""
    p, r = re.findall(r"\w+", pred.lower()), re.findall(r"\w+", ref.lower())
    if not p or not r:
        return float(p == r)
    lcs = _lcs(p, r)
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 2 * prec * rec / (prec + rec)


def load_task(task_dir: str | Path, name: str, limit: int | None = None) -> list[dict]:
    f = Path(task_dir) / f"{name}.jsonl"
    if not f.is_file():
        raise FileNotFoundError(f"'{f}' does not exist; run tools/prepare_data.py --embedded first (or pass "
                                f"--tasks DIR)")
    rows = []
    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}:{n}: not valid JSON ({e.msg}); regenerate the task files with "
                                 f"tools/prepare_data.py --embedded") from None
    if not rows:
        raise ValueError(f"task file '{f}' holds no examples: an evaluation on it would score nothing; regenerate "
                         f"it with tools/prepare_data.py --embedded (or pass --tasks DIR)")
    return rows[:limit] if limit else rows


def _speed(results: list[dict]) -> dict:
    toks = sum(r["num_tokens"] for r in results)
    batches = {(r["seconds"], r["nfe"]) for r in results}      # rows of one batch share its time and forwards
    secs = sum(t for t, _ in batches) or 1e-9
    forwards = sum(n for _, n in batches)
    steps = sum(r["steps"] for r in results) or 1
    # tokens per step counts commits (the reference's parallelism factor), also those cut by a stop
    return {"tokens_per_s": toks / secs, "nfe": sum(r["nfe"] for r in results) / max(len(results), 1),
            "tokens_per_step": sum(r["committed"] for r in results) / steps, "generated_tokens": toks,
            "forwards": forwards, "ms_per_forward": 1e3 * secs / max(forwards, 1)}


def math_accuracy(model, tok, method, rows: list[dict], gc, context: int, batch_size: int = 8,
                  progress=None, chat=None, keep_texts: bool = False) -> dict:
    """Exact match of the extracted answer (module docstring); ``chat``: a ChatRenderer for chat prompts;
    ``keep_texts``: also every generation (``texts``) and whether it was right (``correct``), in row order."""
    if chat is None:
        prompts = [(r, f"Question: {r['question']}\nAnswer:") for r in rows]
        ids = [[tok.bos] + tok.encode(q) for _, q in prompts]
    else:
        prompts = [(r, GSM8K_INSTRUCTION + r["question"]) for r in rows]
        ids = [chat.prompt_ids(q) for _, q in prompts]
    kept = [(r, {"input_ids": t}) for (r, _), t in zip(prompts, ids) if len(t) + 1 <= context]   # + a new token
    if progress and len(kept) < len(rows):
        progress(len(rows) - len(kept))
    rows, reqs = [r for r, _ in kept], [q for _, q in kept]
    out = generate(model, tok, method, reqs, gc, context=context, batch_size=batch_size, progress=progress) \
        if reqs else []
    correct = [extract_answer(o["text"]) == str(r["answer"]).replace(",", "") for o, r in zip(out, rows)]
    eq = [equation_counts(o["text"]) for o in out]
    copied = [_first_number(o["text"]) == _first_number(r["question"]) for o, r in zip(out, rows)]
    kept = {"texts": [o["text"] for o in out], "correct": correct} if keep_texts else {}
    return {"task": "math", "n": len(rows), "skipped_too_long": len(prompts) - len(rows), **kept,
            "accuracy": sum(correct) / max(len(rows), 1),
            "step_accuracy": sum(c for c, _ in eq) / max(sum(t for _, t in eq), 1),
            "copy_accuracy": sum(copied) / max(len(rows), 1), **_speed(out),
            "examples": [{"question": r["question"], "answer": r["answer"], "generated": o["text"],
                          "correct": c} for r, o, c in list(zip(rows, out, correct))[:3]]}


INFILL_TASKS = {"stories": ("story_infill", (2, 3)), "quests": ("quest_infill", (1, 4))}


def story_infill(model, tok, method, rows: list[dict], gc, context: int, batch_size: int = 8,
                 left_only: bool = False, progress=None, task: str = "stories", record: bool = False) -> dict:
    """Infill sentences [lo, hi) of each row (``task``: stories = the middle sentence, quests = 2-4);
    ``record`` (with ``gc.record``): also every decoded row's tokens, commit calls and confidences."""
    name, (lo, hi) = INFILL_TASKS[task]
    reqs, refs, spans, kept = [], [], [], []
    for i, r in enumerate(rows):
        s = r["sentences"]
        prefix, middle, suffix = " ".join(s[:lo]), " " + " ".join(s[lo:hi]), " " + " ".join(s[hi:])
        span = len(tok.encode(middle))
        need = len(tok.encode(prefix)) + span + 2 + (0 if left_only else len(tok.encode(suffix)))
        if need > context:                       # does not fit the model's context
            if progress:
                progress(1)
            continue
        refs.append(middle.strip())
        spans.append(span)
        kept.append(i)
        reqs.append(prefix if left_only else {"prefix": prefix, "suffix": suffix, "span": span})
    skipped = len(rows) - len(reqs)
    if left_only:      # continue the prefix for exactly the span's length (what a left-to-right model sees)
        out = []
        for q, span in zip(reqs, spans):
            g = gc.derive(max_new_tokens=span, stop_at_eos=False)
            out += generate(model, tok, method, [q], g, context=context, batch_size=1)
            if progress:
                progress(1)
    else:
        out = generate(model, tok, method, reqs, gc, context=context, batch_size=batch_size, progress=progress) \
            if reqs else []
    preds = [o["text"] for o in out]
    em = [p.strip() == ref for p, ref in zip(preds, refs)]
    rl = [rouge_l(p, ref) for p, ref in zip(preds, refs)]
    n = len(reqs)
    res = {"task": name + ("_left_only" if left_only else ""), "n": n, "skipped_too_long": skipped,
           "exact_match": sum(em) / max(n, 1), "rouge_l": sum(rl) / max(n, 1), **_speed(out),
           "examples": [{"reference": ref, "generated": p} for ref, p in list(zip(refs, preds))[:3]]}
    if record:
        res["records"] = [{"row": i, "reference": ref, "generated": p, "correct": c, "tokens": o["tokens"],
                           "commit_steps": o["commit_steps"], "confidences": o["confidences"]}
                          for i, ref, p, c, o in zip(kept, refs, preds, em, out)]
    return res


__all__ = ["GSM8K_INSTRUCTION", "last_boxed", "extract_answer", "equation_counts", "rouge_l", "load_task",
           "math_accuracy", "story_infill", "INFILL_TASKS"]
