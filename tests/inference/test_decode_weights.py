"""The decode-weights formats of the plain forward (``setdiff_mega/hfmodel/linears.py``, issue 44).

fp32 (the exact path) and fp32-packed (the CPU kernels of hfmodel/cpu_kernels.py, or oneDNN's prepacked linear where
they cannot be built) must decode exactly the pinned greedy tokens of every method (``data/golden_tokens.json``: each
prompt alone and the prompts as one batch, so a row's tokens do not depend on its batch either); bf16 and int8 are
reduced precision: their logits stay within a stated tolerance of fp32 and their tokens' agreement with the pinned
ones is measured and bounded. The benchmark's forward measurement (``setdiff_mega/inference/forward_bench.py``) is
checked on the main job's shape: its plain fp32 forward is the megatron-core forward bit for bit, and its byte counts
add up. The default, ``auto`` (``linears.resolve``), is fp32-packed on a CPU and fp32 on a GPU, for every flag and
``decoding_model``.
"""
import pytest
import torch

from tests.inference.test_golden_tokens import BOS, EOS, GOLDEN, MASK, PAD, decode_all, golden_model

# relative max |logit error| / max |logit| of one cached decode forward against fp32, and the least fraction of
# pinned greedy tokens a format reproduces on the golden model (measured: see the closing assertions' messages)
TOLERANCE = {"fp32": 0.0, "fp32-packed": 1e-5, "bf16": 3e-2, "int8": 6e-2}
AGREEMENT = {"fp32": 1.0, "fp32-packed": 1.0, "bf16": 0.9, "int8": 0.8}


@pytest.fixture(scope="module")
def twins(mcore):
    """{format: the golden model's plain twin decoding in that format}."""
    from types import SimpleNamespace

    from setdiff_mega.config import load_config
    from setdiff_mega.hfmodel.linears import FORMATS
    from setdiff_mega.inference.engine import plain_model

    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                             "model.zero_init_head=false", "model.init_method_std=0.5",
                             "model.make_vocab_size_divisible_by=8", "data.seq_length=64"])
    tok = SimpleNamespace(vocab_size=61, bos=BOS, eos=EOS, pad=PAD, mask=MASK)
    native = golden_model()
    return native, {f: plain_model(native, cfg, tok, f) for f in FORMATS}, cfg, tok


def _agreement(got: dict, want: dict) -> float:
    same = total = 0
    for name in want:
        for part in ("alone", "batch"):
            for a, b in zip(got[name][part], want[name][part]):
                same += sum(x == y for x, y in zip(a, b)) if len(a) == len(b) else 0
                total += len(b)
    return same / total


@pytest.mark.parametrize("fmt", ["fp32", "fp32-packed", "bf16", "int8"])
def test_each_format_decodes_the_pinned_tokens_or_within_its_stated_agreement(twins, fmt):
    import json

    want = json.loads(GOLDEN.read_text())
    got = decode_all(twins[1][fmt])
    agreement = _agreement(got, want)
    if AGREEMENT[fmt] == 1.0:
        for name in want:
            assert got[name] == want[name], (fmt, name)
    print(f"{fmt}: {agreement:.3f} of the pinned greedy tokens")
    assert agreement >= AGREEMENT[fmt], f"{fmt}: {agreement:.3f} of the pinned greedy tokens"


@pytest.mark.parametrize("fmt", ["fp32-packed", "bf16", "int8"])
def test_a_cached_forwards_logits_stay_within_the_formats_tolerance(twins, fmt):
    from setdiff_mega.decoding.cache import KVCache

    plain = twins[1]
    layers, groups, d = plain["fp32"].cache_shape()
    g = torch.Generator().manual_seed(0)
    cache = KVCache(layers, 2, groups, d, 20)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cache.length.fill_(17)
    tokens = torch.randint(0, 56, (2, 5), generator=g)
    pos = torch.arange(17, 22).expand(2, 5)
    keep = torch.ones(2, 5, 25, dtype=torch.bool)
    keep[:, :, 17:20] = False                              # window slots past the length are never visible
    out = {}
    for f in ("fp32", fmt):
        with plain[f].use_cache(cache), torch.no_grad():
            out[f] = plain[f](tokens, pos, keep, 1)
        cache.discard()
    err = float((out[fmt] - out["fp32"]).abs().max() / out["fp32"].abs().max())
    print(f"{fmt}: relative logit error {err:.2e}")
    assert err <= TOLERANCE[fmt], f"{fmt}: relative logit error {err:.2e}"
    assert plain[fmt].weights().nbytes() < plain["fp32"].weights().nbytes() or fmt == "fp32-packed"


def test_an_unsharded_model_decodes_through_the_plain_forward_whichever_engine_is_named(twins):
    from types import SimpleNamespace

    from setdiff_mega.config import load_config
    from setdiff_mega.hfmodel.generation_setdlm import DecodeModel
    from setdiff_mega.inference.engine import decoding_model

    native = twins[0]
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                             "model.make_vocab_size_divisible_by=8", "data.seq_length=64"])
    tok = SimpleNamespace(vocab_size=61, bos=BOS, eos=EOS, pad=PAD, mask=MASK)
    for engine in ("auto", "plain", "native"):
        dm = decoding_model(native, cfg, tok, engine, "bf16")
        assert isinstance(dm, DecodeModel) and dm.decode_weights == "bf16"
    with pytest.raises(ValueError, match="decode_weights='fp16' is unknown; choose one of fp32, fp32-packed"):
        DecodeModel(twins[1]["fp32"].model, 64, "fp16")


def test_the_forward_benchmark_measures_the_plain_and_megatron_core_forwards_on_the_same_weights(mcore):
    from setdiff_mega.inference import forward_bench

    case = forward_bench.forward_case(forward_bench.SHAPES["main"], repeats=1, forwards=1, bandwidth=10.0)
    rows = {r["engine"]: r for r in case["rows"]}
    assert set(rows) == {"plain-fp32", "plain-fp32-packed", "plain-bf16", "plain-int8", "megatron-core"}
    assert rows["megatron-core"]["logits_rel_err"] == 0.0          # the same function, bit for bit
    assert rows["plain-bf16"]["logits_rel_err"] <= TOLERANCE["bf16"]
    fp32 = rows["plain-fp32"]
    assert rows["plain-bf16"]["weight_bytes"] < 0.51 * fp32["weight_bytes"]
    assert fp32["bytes"] > fp32["weight_bytes"] and fp32["floor_ms"] == pytest.approx(1e3 * fp32["bytes"] / 1e10)
    assert case["chunk_rows"] == 1 + forward_bench.SHAPES["main"].window
    native, cfg, tok = forward_bench.build_models(forward_bench.SHAPES["main"])
    chunk = forward_bench.Chunk(native, cfg.data.seq_length, 4, 2048)
    from setdiff_mega.inference.engine import plain_model

    prof = forward_bench.profile_forward(plain_model(native, cfg, tok), chunk, forwards=1)
    assert len(prof["by_layer_ms"]) == cfg.model.num_layers and prof["head_ms"] > 0
    assert prof["by_part"]["products"] > 0 and prof["by_part"]["attention"] > 0
    assert sum(prof["by_part"].values()) == pytest.approx(prof["ms_per_forward"])


@pytest.mark.parametrize("fmt", ["fp32", "fp32-packed"])
def test_the_padding_of_a_chunk_is_left_out_of_the_products_and_changes_nothing(twins, fmt):
    """``valid=`` (decoding/calls.py: a cached chunk's real entries): the plain forward runs its products over the
    real entries only; their logits equal the padded forward's (fp32: bit for bit), the padding's are zeros, and the
    K / V the cache holds for the real entries are the same."""
    from setdiff_mega.decoding.cache import KVCache

    dm = twins[1][fmt]
    torch.manual_seed(3)
    B, T, C = 3, 6, 16
    layers, groups, d = dm.cache_shape()
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    tok = torch.randint(0, 57, (B, T)).masked_fill(~valid, PAD)
    pos = 4 + torch.arange(T).repeat(B, 1)
    chunk = torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :] & valid[:, :, None]
    outs, caches = [], []
    for ragged in (None, valid):
        cache = KVCache(layers, B, groups, d, C)
        with dm.use_cache(cache):                   # a prefill of 4 entries per row, then the chunk
            dm(torch.randint(0, 57, (B, 4), generator=torch.Generator().manual_seed(0)), torch.arange(4).repeat(B, 1),
               torch.cat([torch.zeros(B, 4, C, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool).tril()[None]
                          .expand(B, 4, 4)], -1), 4)
            cache.commit(torch.full((B,), 4))
            keep = torch.cat([cache.valid()[:, None, :].expand(B, T, C), chunk | torch.eye(T, dtype=torch.bool)], -1)
            outs.append(dm(tok, pos, keep, 2, valid=ragged))
        s = cache.offset + cache.capacity          # the chunk's K / V in the scratch slots, [L, B, g, T, d]
        caches.append(torch.stack([cache.k[:, :, :, s:s + T], cache.v[:, :, :, s:s + T]]).transpose(3, 4))
    padded, packed = outs
    real = valid[:, 2:]
    if fmt == "fp32":
        assert torch.equal(packed[real], padded[real]) and torch.equal(caches[1][:, :, valid], caches[0][:, :, valid])
    else:
        torch.testing.assert_close(packed[real], padded[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[1][:, :, valid], caches[0][:, :, valid], atol=1e-5, rtol=1e-5)
    assert not packed[~real].any() and not caches[1][:, :, ~valid].any()


def test_auto_resolves_to_fp32_packed_on_a_cpu_and_to_fp32_on_a_gpu(monkeypatch):
    from setdiff_mega.hfmodel import linears

    assert linears.packing_usable()                     # this CPU packs (the kernels, else oneDNN)
    assert linears.resolve("auto", "cpu") == linears.resolve("auto", torch.device("cpu")) == "fp32-packed"
    assert linears.resolve("auto", "cuda") == linears.resolve("auto", torch.device("cuda", 0)) == "fp32"
    assert linears.resolve("auto", "cpu", torch.bfloat16) == "fp32"  # a bfloat16 model (export): its own dtype
    for fmt in linears.FORMATS:                         # a named format is itself on any device
        assert linears.resolve(fmt, "cpu") == linears.resolve(fmt, "cuda") == fmt
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # no device named: where models are built
    assert linears.resolve("auto") == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert linears.resolve("auto") == "fp32-packed"
    monkeypatch.setattr(linears, "packing_usable", lambda: False)     # a CPU that packs nothing: the exact path
    assert linears.resolve("auto", "cpu") == "fp32"
    with pytest.raises(ValueError, match="decode_weights='fp16' is unknown; choose one of auto, fp32, fp32-packed"):
        linears.resolve("fp16", "cpu")


def test_the_default_decoding_model_decodes_the_pinned_tokens_in_fp32_packed_on_a_cpu(twins, monkeypatch):
    import json

    from setdiff_mega.inference import engine

    native, _, cfg, tok = twins
    dm = engine.decoding_model(native, cfg, tok)                    # the defaults: engine auto, decode weights auto
    assert engine.weights_format(dm) == dm.decode_weights == dm.weights().format == "fp32-packed"
    want = json.loads(GOLDEN.read_text())
    assert decode_all(dm) == want
    seen = []                                                       # auto is resolved against the model's device
    monkeypatch.setattr(engine, "resolve", lambda *a: seen.append(a) or "fp32")
    assert engine.decoding_model(native, cfg, tok).decode_weights == "fp32"
    assert seen == [("auto", torch.device("cpu"), torch.float32)]
    monkeypatch.setattr(engine, "_unsharded", lambda model: False)  # a sharded model: its own fp32 forward
    assert engine.decoding_model(native, cfg, tok) is native and engine.weights_format(native) == "fp32"
    with pytest.raises(ValueError, match="fp32-packed needs the plain engine"):
        engine.decoding_model(native, cfg, tok, "auto", "fp32-packed")
    with pytest.raises(ValueError, match="choose one of auto, fp32"):
        engine.decoding_model(native, cfg, tok, "auto", "fp16")


def test_without_the_kernels_fp32_packed_uses_onednn_and_still_decodes_the_pinned_tokens(twins, monkeypatch):
    """Where the kernels cannot be built (no compiler: one warning), auto still picks fp32-packed: oneDNN's prepacked
    linear and SDPA, whose tokens are the pinned ones too."""
    import json

    from setdiff_mega.hfmodel import decode_step, linears
    from setdiff_mega.inference.engine import plain_model

    native, _, cfg, tok = twins
    monkeypatch.setattr(linears, "library", lambda: None)
    monkeypatch.setattr(decode_step, "library", lambda: None)
    assert linears.resolve("auto", "cpu") == "fp32-packed"
    dm = plain_model(native, cfg, tok, "fp32-packed")
    w = dm.weights()
    assert w.attention is None and w.head.panels is None and w.head.packed      # oneDNN's layout, SDPA
    assert decode_all(dm) == json.loads(GOLDEN.read_text())


def test_every_decode_weights_flag_defaults_to_auto():
    import argparse
    import runpy

    from setdiff_mega.inference.options import add_generation_arguments
    from setdiff_mega.serve import parse_args

    p = argparse.ArgumentParser()
    add_generation_arguments(p)                         # tools/generate.py, evaluate.py, visualize_decode.py
    assert p.parse_args([]).decode_weights == "auto"
    assert p.parse_args(["--decode-weights", "fp32"]).decode_weights == "fp32"
    assert parse_args(["--checkpoint", "x"]).decode_weights == "auto"                   # tools/serve.py
    bench = runpy.run_path("tools/bench_generate.py", run_name="bench_generate")
    assert bench["parse_args"](["--checkpoint", "x"]).decode_weights == "auto"
    serve_bench = runpy.run_path("tools/bench_serve.py", run_name="bench_serve")
    assert serve_bench["parser"]().parse_args(["--url", "x"]).decode_weights == "auto"
