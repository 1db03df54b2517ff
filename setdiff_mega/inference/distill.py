"""Sequence-level self-distillation data: supervised records answered by a model (``tools/generate.py --distill``).

Each record (``{"messages": [...]}`` or ``{"prompt", "response"}``, as ``tools/preprocess_data.py --sft`` reads
them) keeps everything up to its last assistant turn; that turn becomes the model's greedy answer to the
conversation before it, rendered with the checkpoint's chat template and its generation prompt (as the data is
trained), decoded in batches with the given options. The answer is the generated text up to the first EOS,
stripped (an empty answer becomes "."; one that reaches ``max_new_tokens`` without EOS is kept as cut and
counted). Fine-tuning a diffusion model on its AR parent's own answers lowers the targets' entropy (Kim & Rush
2016; method.md 15); the output is ready for supervised preprocessing.
"""
from __future__ import annotations

from setdiff_mega.data.chat import conversation

from .api import generate


def _question(record: dict, where: str) -> tuple[list[dict], int]:
    """(the messages before the record's last assistant turn, that turn's index)."""
    msgs = conversation(record, lambda: where)
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:
        raise ValueError(f"{where}: the record has no assistant turn to answer")
    return msgs[:last], last


def distill_records(model, tokenizer, method, records: list[dict], config, chat, context: int | None = None,
                    batch_size: int = 64, progress=None) -> tuple[list[dict], dict]:
    """(``records`` with their last assistant turn answered by the model, {answers, cut}) (module docstring)."""
    if chat is None:
        raise ValueError("distillation renders each conversation with the checkpoint's chat template: the tokenizer "
                         "has none (fine-tune with a chat template, or use plain prompts)")
    asked = [_question(r, f"record {i + 1}") for i, r in enumerate(records)]
    outs = generate(model, tokenizer, method, [{"messages": q} for q, _ in asked], config, context=context,
                    batch_size=batch_size, progress=progress, chat=chat)
    eos = tokenizer.token(tokenizer.eos)
    out = []
    for (q, _), o in zip(asked, outs):
        answer = o["text"].split(eos)[0].strip() or "."
        out.append({"messages": [*q, {"role": "assistant", "content": answer}]})
    return out, {"answers": len(out), "cut": sum(eos not in o["text"] for o in outs)}


__all__ = ["distill_records"]
