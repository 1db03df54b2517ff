"""Packing benchmark (a benchmark, not a test): padded vs packed supervised samples on a GSM8K-like length
distribution, measured in the same run.

Conversations: a prompt of ~N(100, 25) tokens (clipped to [30, 250]) and an answer of ~N(200, 70) tokens
(clipped to [40, 600]), random token ids; sample length L = 1024 by default. Both layouts read the same
conversations through :class:`~setdiff_mega.data.supervised`'s padded rows and
:class:`~setdiff_mega.data.packing.PackedConversations`, and train the same model with the same objective
(AdamW steps: :func:`~setdiff_mega.diffusion.inputs_for`, forward, loss, backward, update):

    fill              non-padding positions / all positions of the samples
    targets/sample    answer tokens per sample (the tokens a supervised loss trains on)
    target tok/s      answer tokens per second of training (after ``warmup`` steps), the figure of merit
    sample tok/s      L x samples per second (the same compute per sample in both layouts)

and the packed / padded ratio of target tokens/s. A packed sample costs what a padded one costs (the same T
positions; the per-document mask or decomposition is the packed extra), so the ratio is about the fill ratio.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from setdiff_mega.data.batch import batches
from setdiff_mega.data.packing import PackedConversations
from setdiff_mega.diffusion import build_objective, inputs_for


@dataclass
class Synthetic:
    """In-memory conversations (the source interface of :class:`PackedConversations`): prompt and answer
    lengths drawn as in the module docstring, token ids uniform in [3, vocab)."""

    n: int
    L: int
    vocab: int
    seed: int = 0
    pad: int = 0

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        self.prompts = np.clip(rng.normal(100, 25, self.n), 30, 250).astype(np.int64)
        self.answers = np.clip(rng.normal(200, 70, self.n), 40, 600).astype(np.int64)
        self.ids = [rng.integers(3, self.vocab, p + a) for p, a in zip(self.prompts, self.answers)]

    def lengths(self) -> np.ndarray:
        return np.minimum(self.prompts + self.answers, self.L)

    def conversation(self, i: int):
        tgt = np.zeros(self.prompts[i] + self.answers[i], dtype=bool)
        tgt[self.prompts[i]:] = True
        return self.ids[i][: self.L], tgt[: self.L]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids, tgt = self.conversation(i)
        n = ids.size
        tokens = np.full(self.L, self.pad, dtype=np.int64)
        tokens[:n] = ids
        context = np.zeros(self.L, dtype=bool)
        context[:n] = ~tgt
        return {"tokens": tokens, "context": context, "padding": np.arange(self.L) >= n}


def _train(model, objective, source, micro_batch: int, steps: int, warmup: int) -> dict:
    """``steps`` AdamW steps on ``source``; the timed ones are those after ``warmup``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stream = batches(source, micro_batch)
    t0, targets, samples, losses = None, 0, 0, []
    for step in range(steps):
        if step == warmup:
            t0 = time.perf_counter()
        batch = next(stream)
        inp = inputs_for(objective, batch, seed=step)
        loss, _ = objective.loss(model(**inp.model_kwargs()), inp)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step >= warmup:
            targets += int((~batch.context & ~batch.padding).sum())
            samples += batch.rows
    wall = time.perf_counter() - t0
    return {"seconds": wall, "target_tokens_per_s": targets / wall, "sample_tokens_per_s": samples * source.L / wall,
            "targets_per_sample": targets / max(samples, 1), "final_loss": losses[-1]}


def run(model_cfg, objective: str, options, L: int = 1024, conversations: int = 2000, micro_batch: int = 2,
        steps: int = 6, warmup: int = 1, seed: int = 0, log=print) -> dict:
    """Padded vs packed on the same conversations and model (``model_cfg``: a ModelConfig; ``options``: the
    method's Options), module docstring; returns the rows and the ratio."""
    from setdiff_mega.model import build_model

    vocab = 512
    padded = Synthetic(conversations, L, vocab, seed)
    packed = PackedConversations(padded, seed)
    fill_padded = float(padded.lengths().sum()) / (len(padded) * L)
    obj = build_objective(objective, vocab, options=options, shift_logits=model_cfg.shift_logits)
    rows = {}
    for name, source, fill in (("padded", padded, fill_padded), ("packed", packed, packed.fill())):
        torch.manual_seed(seed)
        model = build_model(model_cfg, vocab + 1)
        log(f"{name}: {len(source)} samples of {L} tokens from {conversations} conversations, fill {fill:.3f}")
        rows[name] = {"samples": len(source), "fill": round(fill, 4), **_train(model, obj, source, micro_batch, steps,
                                                                                 warmup)}
    ratio = rows["packed"]["target_tokens_per_s"] / rows["padded"]["target_tokens_per_s"]
    return {"L": L, "conversations": conversations, "objective": objective, "options": dataclasses.asdict(options),
            "attention_backend": model_cfg.attention_backend, "micro_batch": micro_batch,
            "timed_steps": steps - warmup, "padded": rows["padded"], "packed": rows["packed"],
            "packed_over_padded_target_tokens_per_s": round(ratio, 3),
            "mean_conversations_per_packed_sample": round(conversations / len(packed), 3)}


__all__ = ["run", "Synthetic"]
