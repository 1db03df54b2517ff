"""The CPU decode kernels (``setdiff_mega/hfmodel/cpu_kernels.py``, issue 44) against PyTorch's own operators.

Attention against ``F.scaled_dot_product_attention`` and the small-M linear against ``F.linear`` over the
shapes decoding feeds them (and the awkward ones: GQA, per-head and broadcast masks, views into a larger
buffer, a head dim that is not a multiple of 32, row counts past one pass of 12, output counts past a whole
panel); the build cache keyed by content and reused; no compiler: a clear fallback, never an error; the
fp32-packed format decoding the pinned golden tokens through the oneDNN fallback as well.
"""
import pytest
import torch
import torch.nn.functional as F

from setdiff_mega.hfmodel import cpu_kernels


@pytest.fixture(scope="module")
def lib():
    got = cpu_kernels.library()
    if got is None:
        pytest.skip("no C++ compiler on this machine (the fallback is tested below)")
    return got


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("B,H,G,T,N,d", [(1, 12, 12, 9, 1016, 64), (2, 4, 4, 5, 37, 40), (3, 8, 2, 16, 100, 64),
                                         (1, 4, 4, 1, 7, 33), (2, 6, 3, 12, 9, 96)])
def test_attention_equals_sdpa_on_views_with_boolean_and_additive_masks(lib, B, H, G, T, N, d):
    g = torch.Generator().manual_seed(N)
    q = torch.randn(B, H, T, d, generator=g)
    K = torch.randn(B, G, N + 40, d, generator=g)[:, :, 10:10 + N]          # a view: strided like the cache
    V = torch.randn(B, G, N + 3, d, generator=g)[:, :, :N]
    keep = torch.rand(B, 1, T, N, generator=g) > 0.3
    keep[..., 0] = True
    ref = F.scaled_dot_product_attention(q, K, V, attn_mask=keep, enable_gqa=G != H)
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    assert _rel(lib.attention(q, K, V, keep), ref) < 1e-5
    assert _rel(lib.attention(q, K, V, additive), ref) < 1e-5
    plain = F.scaled_dot_product_attention(q, K, V, enable_gqa=G != H)
    assert _rel(lib.attention(q, K, V, None), plain) < 1e-5
    scaled = F.scaled_dot_product_attention(q, K, V, attn_mask=keep, scale=0.3, enable_gqa=G != H)
    assert _rel(lib.attention(q, K, V, keep, 0.3), scaled) < 1e-5


def test_attention_per_head_masks_and_a_fully_masked_query(lib):
    g = torch.Generator().manual_seed(1)
    q, K, V = (torch.randn(2, 4, 6, 64, generator=g), torch.randn(2, 4, 50, 64, generator=g),
               torch.randn(2, 4, 50, 64, generator=g))
    keep = torch.rand(2, 4, 6, 50, generator=g) > 0.5
    keep[..., 3] = True
    ref = F.scaled_dot_product_attention(q, K, V, attn_mask=keep)
    assert _rel(lib.attention(q, K, V, keep), ref) < 1e-5
    keep[0, 1, 2] = False                                  # query 2 of head 1 sees nothing: zeros, not NaN
    out = lib.attention(q, K, V, keep)
    assert torch.equal(out[0, 1, 2], torch.zeros(64))
    assert torch.isfinite(out).all()


def test_attention_declines_what_it_does_not_cover(lib):
    q, K = torch.randn(1, 2, 17, 64), torch.randn(1, 2, 30, 64)
    assert lib.attention(q, K, K) is None                                    # more than 16 queries
    assert lib.attention(q[:, :, :4].bfloat16(), K.bfloat16(), K.bfloat16()) is None


@pytest.mark.parametrize("M,N,K", [(9, 2304, 768), (1, 50, 33), (13, 100, 768), (30, 70, 40), (8, 1000, 64),
                                   (0, 40, 16)])
def test_the_panel_linear_equals_f_linear(lib, M, N, K):
    g = torch.Generator().manual_seed(M + N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    panels = lib.pack(w)
    assert panels.shape == (-(-N // 32), K, 32)
    y = lib.linear(x, panels, N)
    assert y.shape == (M, N)
    if M:
        assert _rel(y, F.linear(x, w)) < 1e-5
    x3 = torch.randn(2, 3, 2 * K, generator=g)[..., ::2]                        # batched and strided rows
    assert _rel(lib.linear(x3, panels, N), F.linear(x3, w)) < 1e-5


def test_each_row_of_the_linear_is_independent_of_its_batch(lib):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(20, 96, generator=g), torch.randn(70, 96, generator=g)
    panels = lib.pack(w)
    whole = lib.linear(x, panels, 70)
    for i in (0, 11, 12, 19):
        assert torch.equal(lib.linear(x[i:i + 1], panels, 70)[0], whole[i])


def test_the_build_is_cached_by_content_and_reused(lib, tmp_path, monkeypatch):
    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(tmp_path))
    first = cpu_kernels._build()
    assert first.parent == tmp_path and first.name.startswith("cpu_kernels-")
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels._build() == first and first.stat().st_mtime_ns == stamp      # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]                      # no staging left behind
    monkeypatch.setattr(cpu_kernels, "SOURCE", cpu_kernels.SOURCE + "\n/* another */\n")
    assert cpu_kernels._build() != first                                             # keyed by the source


def test_a_build_racing_another_never_replaces_the_library_already_there(lib, tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(tmp_path))
    first = cpu_kernels._build()
    inode = first.stat().st_ino
    real = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: False if p == first else real(p))   # as if another process
    assert cpu_kernels._build() == first                                           # finished in between
    assert first.stat().st_ino == inode and [p.name for p in tmp_path.iterdir()] == [first.name]


def test_no_compiler_means_a_warning_and_the_fallback_not_an_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises((RuntimeError, OSError)):
        cpu_kernels._build()
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        assert "CPU decode kernels unavailable" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()


def test_fp32_packed_decodes_the_pinned_tokens_through_the_onednn_fallback_too(mcore, monkeypatch):
    import json
    from types import SimpleNamespace

    from setdiff_mega.config import load_config
    from setdiff_mega.hfmodel import decode_step, linears
    from setdiff_mega.inference.engine import plain_model
    from tests.inference.test_golden_tokens import BOS, EOS, GOLDEN, MASK, PAD, decode_all, golden_model

    monkeypatch.setattr(linears, "library", lambda: None)
    monkeypatch.setattr(decode_step, "library", lambda: None)
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                             "model.zero_init_head=false", "model.init_method_std=0.5",
                             "model.make_vocab_size_divisible_by=8", "data.seq_length=64"])
    tok = SimpleNamespace(vocab_size=61, bos=BOS, eos=EOS, pad=PAD, mask=MASK)
    model = plain_model(golden_model(), cfg, tok, "fp32-packed")
    weights = model.weights()
    assert weights.attention is None and weights.head.panels is None
    want = json.loads(GOLDEN.read_text())
    assert decode_all(model) == want


def test_fp32_packed_uses_the_kernels_where_they_build(lib, mcore):
    from types import SimpleNamespace

    from setdiff_mega.config import load_config
    from setdiff_mega.inference.engine import plain_model
    from tests.inference.test_golden_tokens import BOS, EOS, MASK, PAD, golden_model

    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                             "model.make_vocab_size_divisible_by=8", "data.seq_length=64"])
    tok = SimpleNamespace(vocab_size=61, bos=BOS, eos=EOS, pad=PAD, mask=MASK)
    weights = plain_model(golden_model(), cfg, tok, "fp32-packed").weights()
    kind = cpu_kernels.Library
    assert isinstance(weights.attention.__self__, kind) and weights.attention.__func__ is kind.attention
    assert all(isinstance(p.panels, kind) for layer in weights.layers for p in layer if hasattr(p, "panels"))
    assert isinstance(weights.head.panels, kind)
    assert plain_model(golden_model(), cfg, tok, "fp32").weights().attention is None
