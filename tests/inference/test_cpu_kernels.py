"""The CPU decode kernels (``setdiff_mega/hfmodel/cpu_kernels.py`` + ``cpu_kernels.cpp``, issues 44 and 58) against
PyTorch's own operators, and the loader's guards.

Attention against ``F.scaled_dot_product_attention`` and the small-M linear against ``F.linear`` over the
shapes decoding feeds them (and the awkward ones: GQA, per-head and broadcast masks, views into a larger
buffer, a head dim that is not a multiple of 32, row counts past one pass of 12, output counts past a whole
panel); the build cache keyed by content and reused; a library whose signature is not the declared one, or a
cached one this loader did not write (tampered, writable by others, another user's, a link, no recorded hash),
refused with one line; no compiler: a clear fallback, never an error; a compiler whose build fails: these
tests fail (they skip only where no compiler is); the fp32-packed format decoding the pinned golden tokens
through the oneDNN fallback as well.
"""
import os
import shutil
import stat
import subprocess

import pytest
import torch
import torch.nn.functional as F

from setdiff_mega.hfmodel import cpu_kernels


@pytest.fixture(scope="module")
def lib():
    """The kernels; skipped only where no C++ compiler is: with one, a failed build or a refused library fails
    every test that uses them, with its reason."""
    if cpu_kernels._compiler() is None:
        pytest.skip("no C++ compiler ($CXX, g++ or c++) on PATH: the kernels are not built (the fallback is tested "
                    "below)")
    got = cpu_kernels.load()
    assert cpu_kernels.library() is not None
    return got


@pytest.fixture(scope="module")
def built(lib, tmp_path_factory):
    """One entry of a private cache built from the shipped source (copied by the tests that change it)."""
    root = tmp_path_factory.mktemp("kernels")
    mp = pytest.MonkeyPatch()
    mp.setenv("SETDIFF_KERNEL_DIR", str(root))
    try:
        return cpu_kernels._build()
    finally:
        mp.undo()


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


def test_the_source_is_a_cpp_file_whose_signature_the_loader_declares(lib):
    assert cpu_kernels.source_path().name == "cpu_kernels.cpp" and cpu_kernels.source_path().parent.name == "hfmodel"
    got = lib.lib.sdm_signature().decode()
    assert got == cpu_kernels.declared_signature()
    assert got.startswith("sdm_decode_attention(ptr,i64,i64,i64,ptr,") and got.count(",") == 28 + 8
    for name, declaration in cpu_kernels.SIGNATURES.items():
        result, types = cpu_kernels._parse(declaration)
        fn = getattr(lib.lib, name)
        assert fn.argtypes == [cpu_kernels.CTYPES[t] for t in types] and fn.restype is cpu_kernels.CTYPES[result]


def test_the_build_is_cached_by_content_and_reused(built, tmp_path, monkeypatch):
    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(tmp_path))
    shutil.copytree(built.parent, tmp_path / built.parent.name)
    first = cpu_kernels._build()
    assert first == tmp_path / built.parent.name / "cpu_kernels.so"                 # the same key: found
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels._build() == first and first.stat().st_mtime_ns == stamp      # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.parent.name]               # no staging left behind
    assert sorted(p.name for p in first.parent.iterdir()) == ["cpu_kernels.cpp", "cpu_kernels.so",
                                                              "cpu_kernels.so.sha256"]
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in (first.parent, first))


def test_a_new_cache_directory_is_private_and_a_shared_one_refused(lib, tmp_path, monkeypatch, caplog):
    root = tmp_path / "a" / "kernels"
    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(root))
    assert cpu_kernels._root() == root and stat.S_IMODE(root.stat().st_mode) == 0o700
    root.chmod(0o777)
    with pytest.raises(cpu_kernels.KernelError, match=r"writable by group or others \(mode 0777\).*chmod 700"):
        cpu_kernels._build()
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None                          # the fallback, after one warning line
        assert [r.getMessage().count("\n") for r in caplog.records if "unavailable" in r.getMessage()] == [0]
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()


def test_a_build_racing_another_never_replaces_the_entry_already_there(built, tmp_path, monkeypatch):
    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(tmp_path))
    shutil.copytree(built.parent, tmp_path / built.parent.name)
    first = tmp_path / built.parent.name / "cpu_kernels.so"
    inode = first.stat().st_ino
    real = os.path.lexists
    monkeypatch.setattr(os.path, "lexists", lambda p: False if str(p) == str(first.parent) else real(p))
    assert cpu_kernels._build() == first                   # as if another process published it in between
    assert first.stat().st_ino == inode and [p.name for p in tmp_path.iterdir()] == [first.parent.name]
    cpu_kernels.Library(first)


def _tamper(lib_path, how: str, monkeypatch):
    if how == "changed bytes":                  # same owner and mode: only the recorded SHA-256 tells
        with open(lib_path, "ab") as f:
            f.write(b"\0")
    elif how == "writable by others":
        lib_path.chmod(0o777)
    elif how == "another user's":
        if os.geteuid() == 0:
            os.chown(lib_path, 12345, 12345)
        else:                                   # not root: this user is someone else instead
            monkeypatch.setattr(cpu_kernels, "_me", lambda: os.geteuid() + 1)
    elif how == "no recorded hash":
        (lib_path.parent / "cpu_kernels.so.sha256").unlink()
    elif how == "a link":
        real = lib_path.with_name("real.so")
        lib_path.rename(real)
        lib_path.symlink_to(real)
    elif how == "a shared entry":
        lib_path.parent.chmod(0o777)


WHY = {"changed bytes": "SHA-256 .* is not the one recorded", "writable by others": "writable by group or others",
       "another user's": "owned by uid", "no recorded hash": "no cpu_kernels.so.sha256 records its SHA-256",
       "a link": "it is a symbolic link", "a shared entry": "writable by group or others"}


@pytest.mark.parametrize("how", list(WHY))
def test_a_cached_library_this_loader_did_not_write_is_refused_before_it_runs(built, tmp_path, monkeypatch, how):
    entry = tmp_path / built.parent.name
    shutil.copytree(built.parent, entry, symlinks=True)
    lib_path = entry / "cpu_kernels.so"
    cpu_kernels.Library(lib_path)                                      # the copy itself loads
    _tamper(lib_path, how, monkeypatch)
    with pytest.raises(cpu_kernels.KernelError, match=WHY[how]) as e:
        cpu_kernels.Library(lib_path)
    assert "\n" not in str(e.value) and str(e.value).startswith("refusing the cached kernels")


def test_a_refused_cache_entry_is_reported_removed_and_rebuilt(built, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(tmp_path))
    entry = tmp_path / built.parent.name
    shutil.copytree(built.parent, entry)
    with open(entry / "cpu_kernels.so", "ab") as f:
        f.write(b"\0")
    got = cpu_kernels._build()
    assert got == entry / "cpu_kernels.so" and [p.name for p in tmp_path.iterdir()] == [entry.name]
    cpu_kernels.Library(got)
    warned = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "is not the one recorded" in warned[0]


def test_a_signature_that_is_not_the_declared_one_is_refused_with_one_line(built, tmp_path, monkeypatch):
    # the Python declaration edited alone (a parameter dropped)
    declared = dict(cpu_kernels.SIGNATURES)
    declared["sdm_linear_panels"] = declared["sdm_linear_panels"].replace(" threads:i32", "")
    monkeypatch.setattr(cpu_kernels, "SIGNATURES", declared)
    with pytest.raises(cpu_kernels.KernelError, match=r"signature sdm_decode_attention\(.*\)->i32;sdm_linear_panels"
                                                        r"\(ptr,i64,ptr,ptr,i64,i64,i64,i64,i32\)->i32 is not the "
                                                        r"declared") as e:
        cpu_kernels.Library(built)
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    # the C++ edited alone (a parameter added): its sdm_signature() follows the real parameter types
    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(tmp_path))
    source = cpu_kernels._source()
    head = "int64_t M, int64_t N, int64_t K, int threads) {"
    assert source.count(head) == 1
    monkeypatch.setattr(cpu_kernels, "_source", lambda: source.replace(head, head.replace("int threads", "int threads, "
                                                                                           "int64_t extra")))
    other = cpu_kernels._build()
    assert other.parent.name != built.parent.name                     # keyed by the source
    with pytest.raises(cpu_kernels.KernelError, match=r"sdm_linear_panels\(ptr,i64,ptr,ptr,i64,i64,i64,i64,i32,i64\)"
                                                        r"->i32 is not the declared") as e:
        cpu_kernels.Library(other)
    assert "\n" not in str(e.value)


def test_a_library_without_a_signature_is_refused(lib, tmp_path):
    entry = tmp_path / "cpu_kernels-old"
    entry.mkdir(mode=0o700)
    (tmp_path / "old.cpp").write_text('extern "C" int sdm_linear_panels() { return 0; }\n')
    subprocess.run([cpu_kernels._compiler(), "-shared", "-fPIC", str(tmp_path / "old.cpp"), "-o",
                    str(entry / "cpu_kernels.so")], check=True)
    (entry / "cpu_kernels.so").chmod(0o700)
    digest = __import__("hashlib").sha256((entry / "cpu_kernels.so").read_bytes()).hexdigest()
    (entry / "cpu_kernels.so.sha256").write_text(f"{digest}  cpu_kernels.so\n")
    with pytest.raises(cpu_kernels.KernelError, match=r"no sdm_signature\(\)"):
        cpu_kernels.Library(entry / "cpu_kernels.so")


def test_a_failing_build_is_an_error_with_the_compilers_words(lib, tmp_path, monkeypatch):
    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo broken 1.0 && exit 0\necho 'cpu_kernels.cpp:1: error: "
                   "no' >&2\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(cxx))
    assert cpu_kernels._compiler() == str(cxx)          # a compiler is here: the lib fixture would fail, not skip
    with pytest.raises(cpu_kernels.KernelError, match="failed to build .*cpu_kernels.cpp: cpu_kernels.cpp:1: error"):
        cpu_kernels.load()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []                     # no staging left behind


def test_an_export_copy_of_the_module_finds_the_source_it_is_given(lib, tmp_path, monkeypatch):
    """transformers copies an export's modules without the .cpp: from_pretrained hands the export's copy over."""
    import importlib.util

    shutil.copy(cpu_kernels.__file__, tmp_path / "cpu_kernels.py")
    spec = importlib.util.spec_from_file_location("copied_cpu_kernels", tmp_path / "cpu_kernels.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    with pytest.raises(copy.KernelError, match="cpu_kernels.cpp is neither beside cpu_kernels.py nor in the export"):
        copy.source_path()
    shipped = tmp_path / "export" / "cpu_kernels.cpp"
    shipped.parent.mkdir()
    shutil.copy(cpu_kernels.source_path(), shipped)
    copy.use_source(shipped)
    assert copy.source_path() == shipped and copy._source() == cpu_kernels._source()


def test_no_compiler_means_a_warning_and_the_fallback_not_an_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SETDIFF_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_kernels._compiler() is None
    with pytest.raises(cpu_kernels.KernelError, match="no C\\+\\+ compiler"):
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
