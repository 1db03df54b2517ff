"""SetDLM's next-token loss on the clean stream (``objective.ar_weight``, issue 38, method.md 15).

* The pairs: every target whose predecessor p - 1 comes earlier in the order is predicted by p - 1's clean row,
  and that row never sees the target (changing the target's token leaves the row's logits unchanged).
* The loss is the objective's plus ar_weight times the per-sequence mean over those pairs, checked against a
  brute-force loop; validation statistics (nll_sum, num_tokens) stay the objective's own.
* With the AR head shift the pairs are exactly the targets that read their predecessor's row.
* ar_weight = 0 leaves the inputs as they were; the config refuses it for other objectives, negative weights and
  context parallelism; FLOPs count the clean rows' logits.
"""
import pytest
import torch

from setdiff_mega.config import ConfigError, load_config
from setdiff_mega.diffusion import build_objective
from setdiff_mega.diffusion.base import masked_token_nll

MASK_ID, VOCAB, L = 60, 61, 16


def _batch(B=3):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 58, (B, L), generator=g)
    ctx = torch.zeros(B, L, dtype=torch.bool)
    ctx[:, :3] = True
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 12:] = True
    return x, ctx, pad


def _inputs(obj, x, ctx, pad, perm=None):
    return obj.build_inputs(x, ctx, pad, generator=torch.Generator().manual_seed(7), perm=perm)


def test_pairs_are_the_predecessors_clean_rows_and_never_see_their_target(tiny_model):
    x, ctx, pad = _batch()
    obj = build_objective("setdlm", MASK_ID, D=3, ar_weight=0.5)
    inp = _inputs(obj, x, ctx, pad)
    perm, rank = inp.extras["perm"], inp.extras["rank"]
    assert inp.logits_start == 0 and inp.ar_mask.any()
    for b in range(x.shape[0]):
        for r in range(L):
            p = int(perm[b, r])
            want = bool(inp.loss_mask[b, r]) and p > 0 and int(rank[b, p - 1]) < r
            assert bool(inp.ar_mask[b, r]) == want
            if want:
                assert int(inp.ar_rows[b, r]) == int(rank[b, p - 1])       # a clean-stream row
            assert int(inp.logit_rows[b, r]) == L + r                      # the diffusion target: its own row
    with torch.no_grad():
        logits = tiny_model(**inp.model_kwargs())
        for b, r in inp.ar_mask.nonzero().tolist()[:12]:
            p, row = int(perm[b, r]), int(inp.ar_rows[b, r])
            y = x.clone()
            y[b, p] = (y[b, p] + 1) % 58
            other = tiny_model(**_inputs(obj, y, ctx, pad, perm=perm).model_kwargs())
            torch.testing.assert_close(other[b, row], logits[b, row])


@pytest.mark.parametrize("shift", [False, True])
def test_loss_adds_the_weighted_per_sequence_next_token_mean(tiny_model, shift):
    x, ctx, pad = _batch()
    base = build_objective("setdlm", MASK_ID, D=3, shift_logits=shift)
    obj = build_objective("setdlm", MASK_ID, D=3, ar_weight=0.7, shift_logits=shift)
    inp0, inp = _inputs(base, x, ctx, pad), _inputs(obj, x, ctx, pad)
    with torch.no_grad():
        logits = tiny_model(**inp.model_kwargs())
        loss0, st0 = base.loss(logits if shift else logits[:, L:], inp0)
        loss, st = obj.loss(logits, inp)
    perm, rank = inp.extras["perm"], inp.extras["rank"]
    means = []
    for b in range(x.shape[0]):
        nll = [masked_token_nll(logits[b, int(rank[b, int(perm[b, r]) - 1])][None], x[b, int(perm[b, r])][None],
                                MASK_ID)[0]
               for r in range(L) if inp.loss_mask[b, r] and perm[b, r] > 0 and rank[b, perm[b, r] - 1] < r]
        means.append(torch.stack(nll).mean())
    torch.testing.assert_close(loss, loss0 + 0.7 * torch.stack(means).mean())
    torch.testing.assert_close(st["nll_sum"], st0["nll_sum"])          # validation stays the objective's
    assert float(st["num_tokens"]) == float(st0["num_tokens"])
    if shift:                                                           # the pairs = the targets read shifted
        assert torch.equal(inp.ar_mask, inp.loss_mask & (inp.logit_rows < L))


def test_zero_weight_leaves_the_inputs_unchanged():
    x, ctx, pad = _batch()
    a = _inputs(build_objective("setdlm", MASK_ID, D=3), x, ctx, pad)
    b = _inputs(build_objective("setdlm", MASK_ID, D=3, ar_weight=0.0), x, ctx, pad)
    assert a.logits_start == b.logits_start == L and a.logit_rows is None and b.ar_rows is None
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)


@pytest.mark.parametrize("overrides,pattern", [
    (["objective.ar_weight=-1"], r"objective.ar_weight=-1.0 must be >= 0"),
    (["objective.name=bd3lm", "objective.ar_weight=1"], r"objective.ar_weight"),
    (["objective.ar_weight=1", "parallel.context_parallel_size=2", "model.attention_backend=setcausal"],
     r"next-token loss on the clean stream.*context_parallel_size=2.*use CP=1"),
])
def test_config_refusals(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config("configs/tiny_cpu.yaml", overrides)


def test_flops_count_the_clean_rows_logits():
    from setdiff_mega.training.flops import flops_terms

    cfg = load_config("configs/tiny_cpu.yaml", ["objective.ar_weight=1"])
    assert cfg.objective.options.every_row_logits
    plain = flops_terms(cfg.model, 1200, "setdlm", 128)
    every = flops_terms(cfg.model, 1200, "setdlm", 128, every_row=True)
    assert every["head"] == 2 * plain["head"] and every["linear"] == plain["linear"]


def test_mask_row_mean(tiny_model):
    """train.init_mask_row=mean sets the MASK row of the embedding to the mean of the tokenizer's other rows."""
    from setdiff_mega.model.token_rows import mean_token_rows

    w = tiny_model.embedding.word_embeddings.weight
    want = torch.cat([w[:MASK_ID], w[MASK_ID + 1:VOCAB]]).mean(0)
    before = w[:MASK_ID].clone()
    mean_token_rows([tiny_model], [MASK_ID], VOCAB)
    torch.testing.assert_close(w[MASK_ID], want)
    assert torch.equal(w[:MASK_ID], before)
    with pytest.raises(ConfigError, match="train.init_mask_row=mean re-initialises.*set train.init_from"):
        load_config("configs/tiny_cpu.yaml", ["train.init_mask_row=mean"])
