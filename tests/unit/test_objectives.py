"""Input builders and losses of the four objectives (pure torch; no model)."""
import math

import pytest
import torch

from setdiff_mega.diffusion import (
    ARObjective,
    BD3LMObjective,
    MDLMObjective,
    SetDLMObjective,
    build_objective,
    masked_token_nll,
    setcausal_mask,
)

MASK = 50
V = 51


def _tokens(B=4, L=16, seed=0):
    return torch.randint(0, 40, (B, L), generator=torch.Generator().manual_seed(seed))


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_factory_and_unknown_objective():
    assert isinstance(build_objective("ar", MASK), ARObjective)
    assert isinstance(build_objective("setdlm", MASK, D=2), SetDLMObjective)
    with pytest.raises(ValueError, match="unknown objective 'gpt'.*ar, mdlm, bd3lm, setdlm"):
        build_objective("gpt", MASK)


def test_setdlm_inputs_layout():
    x = _tokens()
    B, L = x.shape
    obj = SetDLMObjective(MASK, D=4)
    inp = obj.build_inputs(x, generator=_g())
    perm = inp.extras["perm"]
    assert inp.tokens.shape == (B, 2 * L) and inp.logits_start == L
    assert torch.equal(inp.tokens[:, :L], x.gather(1, perm))                 # clean stream = x[perm]
    assert (inp.tokens[:, L:] == MASK).all()                                  # noisy stream all MASK
    assert torch.equal(inp.position_ids, torch.cat([perm, perm], 1))         # original positions, twice
    assert torch.equal(inp.targets, x.gather(1, perm))                       # no logit shift
    assert torch.equal(inp.attention_mask[0], setcausal_mask(L))
    assert inp.loss_mask.all()


def test_setdlm_context_pinned_kept_and_not_scored():
    x = _tokens(B=8, L=20)
    ctx = torch.zeros_like(x, dtype=torch.bool)
    ctx[:, :5] = True
    pad = torch.zeros_like(ctx)
    pad[:, -3:] = True
    obj = SetDLMObjective(MASK, D=4)
    inp = obj.build_inputs(x, context=ctx, padding=pad, generator=_g())
    perm, L = inp.extras["perm"], 20
    assert torch.equal(perm[:, :5], torch.arange(5).expand(8, 5))
    assert torch.equal(perm[:, -3:], torch.arange(17, 20).expand(8, 3))
    assert torch.equal(inp.tokens[:, L:L + 5], x[:, :5])                     # context keeps its ids
    assert (inp.tokens[:, L + 5:L + 17] == MASK).all()
    assert torch.equal(inp.loss_mask, (~ctx & ~pad).gather(1, perm))         # target[perm]
    assert inp.attention_mask.shape == (8, 2 * L, 2 * L)                     # per-sample (padding)
    # no real query sees a padding key
    real_q = torch.cat([~pad.gather(1, perm)] * 2, 1)
    pad_k = torch.cat([pad.gather(1, perm)] * 2, 1)
    assert not (inp.attention_mask & real_q[:, :, None] & pad_k[:, None, :]).any()


def test_setdlm_keep_clean_bos_training_vs_eval():
    x = _tokens()
    obj = SetDLMObjective(MASK, D=8, keep_clean_bos=True)
    tr = obj.build_inputs(x, generator=_g(), training=True)
    ev = obj.build_inputs(x, generator=_g(), training=False)
    assert (tr.extras["perm"][:, 0] == 0).all() and (ev.extras["perm"][:, 0] == 0).all()
    assert tr.loss_mask[:, 0].all()               # BOS is in the training loss
    assert not ev.loss_mask[:, 0].any()           # and dropped from eval NLL


def test_loss_excludes_mask_class_and_normalises_per_sequence():
    targets = torch.tensor([[1, 2, 3], [1, 2, 0]])
    loss_mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    logits = torch.randn(2, 3, V, generator=_g())
    nll = masked_token_nll(logits, targets, MASK)
    huge = logits.clone()
    huge[..., MASK] = 1e4                         # MASK logit must not matter
    assert torch.allclose(masked_token_nll(huge, targets, MASK), nll)
    obj = SetDLMObjective(MASK, D=1)
    from setdiff_mega.diffusion import ModelInputs
    inp = ModelInputs(tokens=targets, position_ids=targets, attention_mask=torch.ones(1, 3, 3).bool(),
                      logits_start=0, targets=targets, loss_mask=loss_mask)
    loss, st = obj.loss(logits, inp)
    want = 0.5 * (nll[0].mean() + nll[1, 0])      # per-sequence mean, then batch mean
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert st["num_tokens"].item() == 4
    assert st["nll_sum"].item() == pytest.approx((nll[0].sum() + nll[1, 0]).item(), rel=1e-6)


def test_ar_inputs_shift():
    x = _tokens()
    inp = ARObjective(MASK).build_inputs(x)
    assert torch.equal(inp.tokens, x[:, :-1]) and torch.equal(inp.targets, x[:, 1:])
    assert torch.equal(inp.position_ids[0], torch.arange(15))
    assert torch.equal(inp.attention_mask[0], torch.ones(15, 15).bool().tril())


def test_mdlm_masks_only_targets_at_rate_t():
    x = _tokens(B=512, L=64)
    ctx = torch.zeros_like(x, dtype=torch.bool)
    ctx[:, :8] = True
    obj = MDLMObjective(MASK)
    inp = obj.build_inputs(x, context=ctx, generator=_g())
    masked = inp.tokens == MASK
    assert not masked[:, :8].any()
    assert torch.equal(masked, inp.loss_mask)
    t = inp.extras["t"]
    rate = masked[:, 8:].float().mean(1)
    assert (rate - t).abs().mean() < 0.06                      # per-row masking rate ~ t
    assert inp.attention_mask.all() and inp.logits_start == 0
    elbo = MDLMObjective(MASK, loss_weighting="elbo").build_inputs(x, generator=_g())
    assert torch.allclose(elbo.weights[:, 0], 1.0 / elbo.extras["t"].double().float(), rtol=1e-5)


def test_bd3lm_every_block_with_targets_gets_a_mask():
    x = _tokens(B=256, L=32)
    obj = BD3LMObjective(MASK, block_size=4, t_eps=1e-3)
    inp = obj.build_inputs(x, generator=_g())
    L = 32
    noisy = inp.tokens[:, L:]
    assert torch.equal(inp.tokens[:, :L], x)
    assert (noisy.view(256, 8, 4) == MASK).any(-1).all()
    assert torch.equal(inp.position_ids[0], torch.arange(L).repeat(2))
    assert inp.logits_start == L
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        BD3LMObjective(MASK, block_size=5).build_inputs(x)


def test_bd3lm_nelbo_weights_are_unbiased_in_evaluation():
    """Evaluation masks each target at its block's rate t and nothing else (the reference re-masks all-clean
    blocks only in training, and at S = 1): then E[sum of 1/t over the masked targets] = the number of targets,
    so the NELBO is unbiased. Re-masking under the 1/t weights (the bug that gave a converted BD3LM a KJV bound of
    34.5 nats per token) makes that sum about 4x the count at S = 4."""
    x = _tokens(B=4096, L=32)
    obj = BD3LMObjective(MASK, block_size=4, t_eps=1e-3, loss_weighting="elbo")
    ev = obj.build_inputs(x, generator=_g(1), training=False)
    assert torch.equal(ev.loss_mask, ev.tokens[:, 32:] == MASK)
    ratio = float((ev.loss_mask * ev.weights).sum() / x.numel())
    assert ratio == pytest.approx(1.0, abs=0.1)               # 1/t has a heavy tail: loose, but 4 is far outside
    tr = obj.build_inputs(x, generator=_g(1), training=True)
    assert float((tr.loss_mask * tr.weights).sum() / x.numel()) > 2.0   # training re-masks (the loss is unweighted)
    assert (tr.tokens[:, 32:].reshape(4096, 8, 4) == MASK).any(-1).all()
    assert not (ev.tokens[:, 32:].reshape(4096, 8, 4) == MASK).any(-1).all()
    one = BD3LMObjective(MASK, block_size=1).build_inputs(x, generator=_g(1), training=False)
    assert (one.tokens[:, 32:] == MASK).all()                  # S = 1 re-masks in evaluation too (the reference)


def test_setdlm_d1_identity_order_in_objective():
    x = _tokens()
    inp = SetDLMObjective(MASK, D=1).build_inputs(x, generator=_g())
    assert torch.equal(inp.extras["perm"], torch.arange(16).expand(4, 16))


def test_uniform_logits_give_log_v_minus_one():
    x = _tokens()
    obj = SetDLMObjective(MASK, D=2)
    inp = obj.build_inputs(x, generator=_g())
    loss, _ = obj.loss(torch.zeros(4, 16, V), inp)
    assert loss.item() == pytest.approx(math.log(V - 1), rel=1e-6)   # MASK excluded from the softmax


def test_elbo_loss_is_weighted_sum_over_target_count():
    x = _tokens(B=2, L=8)
    obj = MDLMObjective(MASK, loss_weighting="elbo")
    inp = obj.build_inputs(x, generator=_g(5))
    logits = torch.randn(2, 8, V, generator=_g(6))
    loss, st = obj.loss(logits, inp)
    nll = masked_token_nll(logits, x, MASK)
    t = inp.extras["t"]
    want = (nll * inp.loss_mask / t[:, None]).sum() / 16
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert st["num_tokens"].item() == 16 and st["nll_sum"].item() == pytest.approx(want.item() * 16, rel=1e-5)


def test_setdlm_fim_reveals_prefix_then_rest_of_document_first_in_position_order():
    EOS = 45
    x = _tokens(B=256, L=32)
    x[:, 13] = EOS                                   # two documents per row: [1, 13] and [14, 31]
    obj = SetDLMObjective(MASK, D=4, keep_clean_bos=True, eos_id=EOS, fim_rate=0.5)
    perm = obj.build_inputs(x, generator=_g(3), training=True).extras["perm"]
    assert torch.equal(perm.sort(1).values, torch.arange(32).expand(256, 32))        # still a permutation
    g = _g(3)                                        # the same draws as the order: exponentials, then FIM
    torch.rand(256, 32, dtype=torch.float64, generator=g)
    permutable = torch.ones(256, 32, dtype=torch.bool)
    permutable[:, 0] = False
    pinned = obj.fim_pinned(x, permutable, g)
    rows = pinned.any(1)
    assert 96 < int(rows.sum()) < 160                                                # about half the rows
    middles, with_suffix = set(), 0
    for b in torch.nonzero(rows).flatten().tolist():
        pos = torch.nonzero(pinned[b]).flatten()
        assert torch.equal(perm[b, 1:1 + len(pos)], pos)                             # revealed first, in order
        free = ~pinned[b]
        free[0] = False
        a = int(torch.nonzero(free).flatten()[0])
        assert pinned[b, 1:a].all()                                                  # the prefix [1, a)
        end = 14 if a <= 13 else 32                                                  # the end of a's document
        rest = torch.nonzero(pinned[b, a:]).flatten()
        if len(rest):                                                                # a suffix span [bb, end)
            bb = a + int(rest[0])
            assert pinned[b, bb:end].all() and not pinned[b, end:].any() and bb < end
            with_suffix += 1
        else:                                                                        # the middle reaches the end
            bb = end
        assert not (x[b, a:bb - 1] == EOS).any()                                     # inside one document
        middles.add((a, bb))
    assert with_suffix > len(middles) / 2 and len(middles) > 60                      # varied middles
    ev = obj.build_inputs(x, generator=_g(3), training=False).extras["perm"]
    plain = SetDLMObjective(MASK, D=4, keep_clean_bos=True, eos_id=EOS)
    assert torch.equal(ev, plain.build_inputs(x, generator=_g(3), training=False).extras["perm"])  # eval: plain
    off = SetDLMObjective(MASK, D=4, keep_clean_bos=True, eos_id=EOS, fim_rate=0.0)
    assert torch.equal(off.build_inputs(x, generator=_g(3)).extras["perm"],
                       plain.build_inputs(x, generator=_g(3)).extras["perm"])
    with pytest.raises(ValueError, match="fim_rate"):
        SetDLMObjective(MASK, D=4, fim_rate=1.5)


def test_setdlm_fim_orders_do_not_depend_on_the_batch():
    """FIM draws come from each sample's own generator: a sample gets the same order alone or in any batch
    (what layout-independent training and exact resumes need)."""
    from setdiff_mega.diffusion import build_inputs_per_sample

    EOS = 45
    x = _tokens(B=6, L=24)
    x[:, 9] = EOS
    obj = SetDLMObjective(MASK, D=4, keep_clean_bos=True, eos_id=EOS, fim_rate=0.7)
    ids = [11, 12, 13, 14, 15, 16]
    full = build_inputs_per_sample(obj, x, ids, seed=5).extras["perm"]
    part = build_inputs_per_sample(obj, x[[4, 1]], [ids[4], ids[1]], seed=5).extras["perm"]
    assert torch.equal(part, full[[4, 1]])
