"""Context-parallel sharding (setdiff_mega/parallel/context.py) in one process: the CP ranks' shards, with
the keys each rank gathers, reproduce full attention row for row, and their losses and statistics add up to
the full micro-batch's, for every objective (AR's odd L - 1 positions padded)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from setdiff_mega import methods
from setdiff_mega.diffusion import build_objective
from setdiff_mega.parallel.context import shard_indices, shard_inputs

MASK, EOS, V = 50, 49, 51


def _inputs(name, B=3, L=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    obj = build_objective(name, MASK, block_size=4, D=2, eos_id=EOS)
    tokens = torch.randint(0, 49, (B, L), generator=g)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[0, -3:] = True                      # a padded row: per-batch masks and counts
    tokens[padding] = 0
    return obj, obj.build_inputs(tokens, padding=padding, generator=g)


def test_indices_balance_the_chunks_and_cover_every_position():
    idx0, Lp = shard_indices(32, 2, 2, 0)
    idx1, _ = shard_indices(32, 2, 2, 1)
    assert Lp == 16
    assert idx0.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 28, 29, 30, 31]
    assert sorted(torch.cat([idx0, idx1]).tolist()) == list(range(32))
    idx, Lp = shard_indices(15, 1, 2, 1)       # AR: L - 1 = 15 positions padded to 16
    assert Lp == 16 and idx.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("name", ["ar", "mdlm", "bd3lm", "setdlm"])
@pytest.mark.parametrize("cp", [2, 4])
def test_shards_reproduce_attention_loss_and_stats(name, cp):
    obj, full = _inputs(name)
    streams = methods.get(name).streams
    B, T = full.tokens.shape
    H, d = 2, 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, H, T + 4, d, generator=g)          # per-position q / k / v from the position id
    qkv = lambda pos: x.gather(2, pos[:, None, :, None].expand(B, H, pos.shape[1], d))  # noqa: E731
    mask = full.attention_mask.bool()[:, None]
    ref = F.scaled_dot_product_attention(qkv(full.position_ids), qkv(full.position_ids), qkv(full.position_ids),
                                         attn_mask=mask)
    logits = torch.randn(B, T - full.logits_start, V, generator=g, requires_grad=True)
    loss, st = obj.loss(logits, full)
    loss.backward()
    parts, grads = [], torch.zeros_like(logits)
    shards = [shard_inputs(full, streams, cp, r) for r in range(cp)]
    keys_pos = torch.cat([s.position_ids for s in shards], 1)           # what the all-gather returns
    for r, sh in enumerate(shards):
        idx, Lp = shard_indices(T, streams, cp, r)
        real = idx < T if streams == 1 else (idx % Lp) < T // streams
        orig = idx if streams == 1 else (idx // Lp) * (T // streams) + idx % Lp
        out = F.scaled_dot_product_attention(qkv(sh.position_ids), qkv(keys_pos), qkv(keys_pos),
                                             attn_mask=sh.attention_mask[:, None])
        torch.testing.assert_close(out[:, :, real], ref[:, :, orig[real]])
        assert torch.isfinite(out).all()                                # padding rows see themselves
        # this rank's logit rows: the full logits at its positions past logits_start
        rows = orig[real & (orig >= full.logits_start)] - full.logits_start
        local = torch.zeros(B, sh.targets.shape[1], V)
        keep = (real & (orig >= full.logits_start))[idx >= (full.logits_start // (T // streams)) * Lp]
        local[:, keep] = logits.detach()[:, rows]
        local.requires_grad_(True)
        lo, s = obj.loss(local, sh)
        lo.backward()
        grads[:, rows] += local.grad[:, keep]
        parts.append((lo.item(), float(s["nll_sum"]), float(s["num_tokens"])))
    assert sum(p[0] for p in parts) == pytest.approx(loss.item(), rel=1e-5)
    assert sum(p[1] for p in parts) == pytest.approx(float(st["nll_sum"]), rel=1e-5)
    assert sum(p[2] for p in parts) == pytest.approx(float(st["num_tokens"]))
    torch.testing.assert_close(grads, logits.grad)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_setcausal_segments_on_each_rank_reproduce_attention_and_gradients(cp):
    """The set-causal decomposition over a CP rank's view (its chunks x the gathered keys) gives the rows
    and, summed over the ranks, the gradients of the mask-free decomposition of the whole sequence."""
    from setdiff_mega.model.segments import segment_attention
    from setdiff_mega.model.setcausal import SetCausalCoreAttention, setcausal_attention_math

    obj, full = _inputs("setdlm")
    B, T = full.tokens.shape
    g = torch.Generator().manual_seed(2)
    q, k, v, gout = (torch.randn(B, 2, T, 8, generator=g) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = setcausal_attention_math(*leaves, 0.3)
    ref_grads = torch.autograd.grad(ref, leaves, gout)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for r in range(cp):
        view = shard_inputs(full, 2, cp, r).attention_pattern
        assert view.is_view and SetCausalCoreAttention.decomposable(view, q[:, :, view.rows])
        order, plan = SetCausalCoreAttention.view_plan(view, q.device)
        x = [q[:, :, view.rows].clone().requires_grad_(), k[:, :, view.cols].clone().requires_grad_(),
             v[:, :, view.cols].clone().requires_grad_()]                       # local queries, gathered keys
        out = segment_attention(x[0], x[1].index_select(2, order), x[2].index_select(2, order), plan, 0.3)
        torch.testing.assert_close(out, ref[:, :, view.rows].detach())
        dq, dk, dv = torch.autograd.grad(out, x, gout[:, :, view.rows])
        grads[0][:, :, view.rows] += dq
        grads[1][:, :, view.cols] += dk
        grads[2][:, :, view.cols] += dv
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["ar", "bd3lm", "setdlm"])
def test_flex_attention_on_each_rank_view_matches_the_mask_rows(name):
    """FlexAttention's block mask of a CP rank's view (T_loc x T', forward only on CPU) gives the masked rows."""
    from setdiff_mega.model.flex import flex_attention

    obj, full = _inputs(name)
    streams = methods.get(name).streams
    B, T = full.tokens.shape
    for r in range(2):
        sh = shard_inputs(full, streams, 2, r)
        n = sh.tokens.shape[1]
        g = torch.Generator().manual_seed(r)
        q, k, v = torch.randn(B, 2, n, 8, generator=g), torch.randn(B, 2, 2 * n, 8, generator=g), \
            torch.randn(B, 2, 2 * n, 8, generator=g)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=sh.attention_mask[:, None])
        torch.testing.assert_close(flex_attention(q, k, v, sh.attention_pattern), want)


@pytest.mark.parametrize("name", ["ar", "mdlm", "bd3lm", "setdlm"])
def test_pattern_only_inputs_shard_to_the_same_rows(name):
    """With ``dense_masks=False`` the objective builds no mask; each rank's rows, built from the pattern,
    are the rows sliced from the full dense mask."""
    obj, full = _inputs(name)
    lazy = build_objective(name, MASK, block_size=4, D=2, eos_id=EOS, dense_masks=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 49, (3, 16), generator=g)
    padding = torch.zeros(3, 16, dtype=torch.bool)
    padding[0, -3:] = True
    tokens[padding] = 0
    dense_inp = obj.build_inputs(tokens, padding=padding, generator=torch.Generator().manual_seed(1))
    lazy_inp = lazy.build_inputs(tokens, padding=padding, generator=torch.Generator().manual_seed(1))
    assert lazy_inp.attention_mask is None and lazy_inp.attention_pattern is not None
    streams = methods.get(name).streams
    T = dense_inp.tokens.shape[1]
    for r in range(2):
        a = shard_inputs(dense_inp, streams, 2, r)
        b = shard_inputs(lazy_inp, streams, 2, r)
        sliced = shard_inputs(dataclasses.replace(dense_inp, attention_pattern=None), streams, 2, r)
        idx, Lp = shard_indices(T, streams, 2, r)
        real = (idx % Lp) < T // streams                # the CP layout's padding rows are never read
        assert b.attention_mask is None                 # pattern only: the core attention builds the rows
        for m in (a.attention_mask, b.attention_pattern.dense()):
            assert torch.equal(m.expand_as(sliced.attention_mask)[:, real], sliced.attention_mask[:, real])
