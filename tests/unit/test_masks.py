"""Attention masks: the four set-causal rules (method.md 4.1), the rank form, BD3LM, padding."""
import pytest
import torch

from setdiff_mega.diffusion import (
    bidirectional_mask,
    block_diffusion_mask,
    causal_mask,
    invert,
    setcausal_mask,
    setcausal_mask_from_ranks,
    with_key_padding,
)


@pytest.mark.parametrize("L", [1, 2, 7, 32])
def test_setcausal_four_rules(L):
    m = setcausal_mask(L)
    assert m.shape == (2 * L, 2 * L) and m.dtype == torch.bool
    for q in range(2 * L):
        for k in range(2 * L):
            i, j = q % L, k % L
            clean_q, clean_k = q < L, k < L
            if clean_q and clean_k:
                want = j <= i           # causal, includes self
            elif not clean_q and clean_k:
                want = j < i            # strictly earlier: never its own clean copy
            elif not clean_q and not clean_k:
                want = j == i           # only itself among the noisy tokens
            else:
                want = False            # clean never sees noisy
            assert bool(m[q, k]) == want, (q, k)


def test_noisy_query_never_sees_own_clean_copy():
    L = 16
    m = setcausal_mask(L)
    assert not torch.diagonal(m[L:, :L]).any()
    assert torch.diagonal(m[L:, L:]).all()


def test_rank_form_equals_permuted_form_after_permutation():
    L, B = 12, 5
    perms = torch.stack([torch.randperm(L, generator=torch.Generator().manual_seed(i)) for i in range(B)])
    rank = invert(perms)
    orig = setcausal_mask_from_ranks(rank)                    # [B, 2L, 2L] in original-position space
    static = setcausal_mask(L)
    for b in range(B):
        idx = torch.cat([perms[b], perms[b] + L])             # permuted index -> original index
        assert torch.equal(orig[b][idx][:, idx], static)


def test_identity_rank_form_equals_static():
    L = 9
    assert torch.equal(setcausal_mask_from_ranks(torch.arange(L)[None])[0], setcausal_mask(L))


def test_bd3lm_block_size_one_is_setcausal():
    for L in (1, 4, 16):
        assert torch.equal(block_diffusion_mask(L, 1), setcausal_mask(L))


def test_bd3lm_block_structure():
    L, S = 8, 4
    m = block_diffusion_mask(L, S)
    blk = torch.arange(L) // S
    cc, nc, nn, cn = m[:L, :L], m[L:, :L], m[L:, L:], m[:L, L:]
    assert torch.equal(cc, blk[None, :] <= blk[:, None])
    assert torch.equal(nc, blk[None, :] < blk[:, None])
    assert torch.equal(nn, blk[None, :] == blk[:, None])
    assert not cn.any()


def test_causal_and_bidirectional():
    assert torch.equal(causal_mask(4), torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]).bool())
    assert bidirectional_mask(3).all()


def test_key_padding_hides_pad_and_keeps_rows_nonempty():
    T = 6
    valid = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]).bool()
    m = with_key_padding(bidirectional_mask(T), valid)
    assert m.shape == (2, T, T)
    assert not m[0, :4, 4:].any()             # real queries never see padding
    assert m.any(-1).all()                    # no empty row (no NaN softmax)
    assert torch.equal(m[1], bidirectional_mask(T))
    assert with_key_padding(causal_mask(T), None) is not None
