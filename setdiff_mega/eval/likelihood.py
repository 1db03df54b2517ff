"""Per-sequence negative log-likelihoods for every objective (the numbers behind perplexity and lm-eval).

For clean tokens x [B, L] with optional ``context`` (given, never scored) and ``padding`` [B, L] (bool),
:func:`sequence_nll` returns, per sequence, ``nll`` [B] (nats, summed over the scored tokens) and ``count``
[B] (the number of scored tokens):

* AR: the exact -log p(x_target | x_<) (teacher forcing; position 0 is never predicted).
* SetDLM: the any-order bound for one sampled order from the staggered prior, -log p(x | sigma); with
  ``samples = K`` orders, the mean over K (``nll``) and the tighter -log mean_k p(x | sigma_k) (``nll_lme``;
  both are upper bounds of -log p(x) in expectation). With ``keep_clean_bos``, BOS is not scored (method.md P7).
* MDLM / BD3LM: the NELBO, sum over targets of 1/t * masked NLL for t ~ U[eps, 1] (per block for BD3LM),
  averaged over K draws of t and of the mask (an upper bound of -log p(x)).

Noise for row i and draw k comes from a generator seeded by (seed, row_ids[i], k), so results are
reproducible and do not depend on batching (text: the chunk's index within its document; a dataset:
the sample index). All scores use fp32 log-softmax with the MASK class excluded.
"""
from __future__ import annotations

import contextlib
import math

import torch

from setdiff_mega import methods
from setdiff_mega.data.batch import Batch, collate
from setdiff_mega.data.loader import build_splits, wrap_ids
from setdiff_mega.diffusion import build_objective, inputs_for
from setdiff_mega.diffusion.objectives import masked_token_nll


def elbo_objective(objective):
    """The same objective with 1/t ELBO weights (MDLM / BD3LM); others are returned unchanged."""
    if methods.get(objective.name).likelihood != "NELBO" or getattr(objective, "loss_weighting", "") == "elbo":
        return objective
    kw = {"block_size": objective.block_size} if hasattr(objective, "block_size") else {}
    t_eps = getattr(getattr(objective, "schedule", None), "eps", 1e-3)
    return build_objective(objective.name, objective.mask_id, loss_weighting="elbo", t_eps=t_eps,
                           shift_logits=objective.shift_logits, **kw)


@torch.no_grad()
def sequence_nll(model, objective, tokens: torch.Tensor, context: torch.Tensor | None = None,
                 padding: torch.Tensor | None = None, samples: int = 1, seed: int = 0, row_ids=None,
                 autocast=None, greedy: bool = False) -> dict:
    """{'nll': [B], 'count': [B], 'nll_lme': [B]} in float64 (see the module docstring); with ``greedy``,
    also 'greedy' [B] (bool): every scored token is the argmax of its prediction in the first draw."""
    obj = elbo_objective(objective)
    B, L = tokens.shape
    row_ids = list(range(B)) if row_ids is None else list(row_ids)
    context = torch.zeros_like(tokens, dtype=torch.bool) if context is None else context.bool()
    padding = torch.zeros_like(tokens, dtype=torch.bool) if padding is None else padding.bool()
    target = ~(context | padding)
    draws = []
    count = None
    is_greedy = []
    for k in range(1 if methods.get(obj.name).likelihood == "exact" else max(1, samples)):
        rows = []
        for i in range(B):
            # draw k of row i: the row's sample id (row_ids[i], k) seeds its noise (inputs_for's rule)
            batch = Batch(tokens[i:i + 1], [int(row_ids[i]) * 7919 + k], context=context[i:i + 1],
                          padding=padding[i:i + 1])
            inp = inputs_for(obj, batch, seed, training=False)
            with (autocast() if autocast else contextlib.nullcontext()):
                logits = inp.target_logits(model(**inp.model_kwargs()))
            nll = masked_token_nll(logits, inp.targets, obj.mask_id).double()
            m = inp.loss_mask.double()
            w = m if inp.weights is None else m * inp.weights.double()
            rows.append((nll * w).sum(-1))
            if k == 0 and greedy:
                lg = logits.float().index_fill(-1, torch.tensor([obj.mask_id], device=logits.device), float("-inf"))
                hit = (lg.argmax(-1) == inp.targets) | ~inp.loss_mask
                is_greedy.append(bool(hit.all()))
            if k == 0:
                n = target[i:i + 1].sum(-1).double() if inp.weights is not None else m.sum(-1)
                count = n if count is None else torch.cat([count, n])
        draws.append(torch.cat(rows))
    d = torch.stack(draws)                                        # [K, B]
    lme = -(torch.logsumexp(-d, 0) - math.log(d.shape[0]))
    out = {"nll": d.mean(0), "nll_lme": lme, "count": count}
    if greedy:
        out["greedy"] = torch.tensor(is_greedy)
    return out


def chunk_documents(docs: list[list[int]], L: int, bos: int, eos: int) -> tuple[list[list[int]], list[int]]:
    """Documents as ``[BOS] tokens [EOS]`` cut into pieces of at most L tokens (the last one shorter):
    (pieces, index of each piece within its document). Pieces after the first start mid-document; they
    are scored independently."""
    out, ids = [], []
    for d in docs:
        seq = [bos, *d, eos]
        for j, i in enumerate(range(0, len(seq), L)):
            if len(seq[i:i + L]) > 1:
                out.append(seq[i:i + L])
                ids.append(j)
    return out, ids


def pad_batch(seqs: list[list[int]], L: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to L: (tokens [B, L], padding [B, L])."""
    tokens = torch.full((len(seqs), L), pad, dtype=torch.long)
    padding = torch.ones(len(seqs), L, dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s[:L])
        padding[i, :len(s)] = False
    return tokens, padding


def text_nll(model, objective, tokenizer, texts: list[str], L: int, samples: int = 1, seed: int = 0,
             batch_size: int = 8, progress=None) -> dict:
    """Token-weighted NLL and perplexity of raw texts (chunked to L like training data)."""
    chunks, ids = chunk_documents([tokenizer.encode(t) for t in texts], L, tokenizer.bos, tokenizer.eos)
    total = total_lme = n = 0.0
    for j in range(0, len(chunks), batch_size):
        tokens, padding = pad_batch(chunks[j:j + batch_size], L, tokenizer.pad)
        r = sequence_nll(model, objective, tokens, padding=padding, samples=samples, seed=seed,
                         row_ids=ids[j:j + batch_size])
        total += float(r["nll"].sum())
        total_lme += float(r["nll_lme"].sum())
        n += float(r["count"].sum())
        if progress:
            progress(len(chunks[j:j + batch_size]))
    nll = total / max(n, 1.0)
    return {"nll_per_token": nll, "ppl": math.exp(min(nll, 50)), "nll_per_token_lme": total_lme / max(n, 1.0),
            "tokens": int(n), "sequences": len(chunks), "nll_sum": total}


def split_nll(model, objective, tok, cfg, path: str | None = None, max_sequences: int = 256, orders: int = 1,
              seed: int = 0, batch_size: int = 8, split: str = "valid", progress=None) -> dict:
    """NLL on a split of an indexed dataset (default: the checkpoint's data, split and seed), each sample
    wrapped like the checkpoint's training samples."""
    path = path or cfg.data.path
    n = max_sequences
    splits = dict(zip(("train", "valid", "test"), build_splits(path, tok, cfg.data.seq_length, cfg.data.split,
                                                               cfg.data.seed, (n, n, n), cfg.data.cache_dir,
                                                               cfg.data.check_tokenizer, needed=(split,),
                                                               fmt=cfg.data.format, overlong=cfg.data.sft_overlong)))
    data = splits[split]
    if data is None or len(data) == 0:
        raise ValueError(f"'{path}' has no {split} split (data.split={cfg.data.split}); pass --text")
    wrap = wrap_ids(cfg.data, tok)
    total = total_lme = count = 0.0
    m = min(n, len(data))
    for j in range(0, m, batch_size):
        idx = range(j, min(j + batch_size, m))
        # the checkpoint was trained (and validated) on wrapped chunks: the same collation
        batch = collate([data[i] for i in idx], list(idx), j, wrap)
        r = sequence_nll(model, objective, batch.tokens, batch.context, batch.padding, samples=orders, seed=seed,
                         row_ids=idx)
        total, total_lme, count = total + float(r["nll"].sum()), total_lme + float(r["nll_lme"].sum()), \
            count + float(r["count"].sum())
        if progress:
            progress(len(idx))
    nll = total / max(count, 1.0)
    return {"source": str(path), "split": split, "sequences": m, "tokens": int(count), "nll_per_token": nll,
            "nll_per_token_lme": total_lme / max(count, 1.0), "ppl": math.exp(min(nll, 50)), "orders": orders}


__all__ = ["sequence_nll", "text_nll", "split_nll", "chunk_documents", "pad_batch", "elbo_objective"]
