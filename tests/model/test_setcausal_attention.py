"""The mask-free set-causal attention (two causal kernel calls + log-sum-exp merge, custom backward) equals
dense attention under the 2L set-causal mask: outputs and gradients, with padding, and exactly on row 0."""
import pytest
import torch
import torch.nn.functional as F

from setdiff_mega.diffusion.masks import setcausal_mask
from setdiff_mega.model.setcausal import setcausal_attention, setcausal_attention_math


def _inputs(B=2, H=3, L=9, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, 2 * L, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _dense(q, k, v, keep):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("L", [1, 2, 9, 32])
def test_outputs_and_gradients_equal_the_dense_mask_reference(L):
    q, k, v = _inputs(L=L)
    keep = setcausal_mask(L)
    out = setcausal_attention(q, k, v)
    ref = _dense(q, k, v, keep)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b, name in zip(got, want, "qkv"):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_row_whose_only_key_is_itself_is_exact():
    """Noisy query of rank 0 sees only its own key: its output is v exactly (no rounding in the merge)."""
    q, k, v = _inputs(L=5)
    out = setcausal_attention(q, k, v)
    assert torch.equal(out[:, :, 5], v[:, :, 5].detach())


def test_padding_rows_do_not_change_real_rows():
    """Right padding takes the last ranks: the rows of real tokens (and all gradients when the loss reads
    only them) equal the dense reference with key padding."""
    from setdiff_mega.diffusion.masks import with_key_padding

    L, n_real = 8, 5
    q, k, v = _inputs(L=L, seed=3)
    valid = torch.zeros(1, 2 * L, dtype=torch.bool)
    valid[0, :n_real] = valid[0, L:L + n_real] = True
    keep = with_key_padding(setcausal_mask(L), valid)
    rows = torch.cat([torch.arange(n_real), L + torch.arange(n_real)])
    out = setcausal_attention(q, k, v)[:, :, rows]
    ref = _dense(q, k, v, keep[:, None])[:, :, rows]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_odd_length_is_refused():
    q = torch.zeros(1, 1, 5, 4)
    with pytest.raises(ValueError, match="needs the 2L layout"):
        setcausal_attention(q, q, q)


def test_portable_math_decomposition_equals_the_dense_reference():
    """The plain-ops path (used off CPU) computes the same outputs and gradients."""
    L = 7
    q, k, v = _inputs(L=L, seed=5)
    out = setcausal_attention_math(q, k, v, 0.25)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=setcausal_mask(L), scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
