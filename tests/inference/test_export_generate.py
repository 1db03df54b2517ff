"""The exported Hugging Face model decodes on its own, with the same tokens as the native sampler (issue 17).

One matrix runs the native path (megatron-core model, setdiff_mega.inference) and the export's
``model.generate`` (plain PyTorch remote code) on the same checkpoints: SetDLM W in {1, 4} x tau in
{0.5, 1e6} with a prompt, with BOS only and infilling, decoding past the training length (the crop);
AR, BD3LM and MDLM; each diffusion method also with the AR head alignment (``model.shift_logits``); sampling,
stop strings; the AR-anchored commit rule (``commit_rule="leftmost"``). Greedy (and seeded sampled) tokens
must be identical. A
fresh interpreter in which ``setdiff_mega`` and ``megatron`` cannot be imported loads and decodes the
export; bad export directories fail at load with one clear error.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

L = 24                      # training length: 40 generated tokens run past it (the crop)
METHODS = {"setdlm": ["objective.D=2"], "ar": [], "bd3lm": ["objective.block_size=4"], "mdlm": []}
SHIFT = ["model.shift_logits=true"]       # the AR head alignment (method.md 13): every sampler reads it alike
METHODS.update({f"{m}_shift": [f"objective.name={m}", *METHODS[m], *SHIFT] for m in ("setdlm", "bd3lm", "mdlm")})
TEXTS = {"prompt": ["Question: what is 3 plus", "Once upon"], "bos_only": ["", ""],
         "infill": [("Question: what", "plus 4?", 5), ("Once", "time", 3)]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from setdiff_mega.data.prepare import prepare
    from setdiff_mega.data.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("tok")
    prepare(out, None, num_math=60, num_stories=60, vocab_size=300, heldout=2, log=lambda *a: None)
    return Tokenizer.from_file(out / "tokenizer.json")


@pytest.fixture(scope="module")
def exports(mcore, tmp_path_factory, tokenizer):
    """objective -> (native model, objective, RunConfig, export dir); random weights with a large init std
    so that greedy outputs depend on the context."""
    from setdiff_mega.checkpoint import convert, load_model, save_model_checkpoint
    from setdiff_mega.config import load_config
    from setdiff_mega.model import build_model

    out = {}
    for i, (name, extra) in enumerate(METHODS.items()):
        d = tmp_path_factory.mktemp(name)
        cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                                 "model.zero_init_head=false", "model.init_method_std=0.3", f"data.seq_length={L}",
                                 f"objective.name={name.split('_')[0]}", *extra])
        torch.manual_seed(i)
        ck = save_model_checkpoint(d / "native", 3, build_model(cfg.model, tokenizer.vocab_size), cfg, tokenizer)
        model, objective, _, cfg = load_model(ck)
        out[name] = (model.eval(), objective, cfg, convert.export(ck, d / "hf"))
    return out


def _ids(tokenizer, kind):
    rows = []
    for t in TEXTS[kind]:
        if isinstance(t, tuple):
            p, s, m = t
            rows.append([tokenizer.bos, *tokenizer.encode(p), *[tokenizer.mask] * m, *tokenizer.encode(s),
                         tokenizer.eos])
        else:
            rows.append([tokenizer.bos, *tokenizer.encode(t)])
    return rows


def _native(exp, tokenizer, rows, options):
    from setdiff_mega.inference import Canvas, build_sampler
    from setdiff_mega.inference.options import generation_config

    model, objective, cfg, _ = exp
    gc = generation_config(cfg.objective, cfg.data.seq_length, overrides=options)
    out = build_sampler(objective, model, tokenizer, gc).generate(
        Canvas.from_prompts(rows, tokenizer.mask, tokenizer.pad, gc.max_new_tokens))
    return out.tokens, out.nfe


def _batch(rows, pad):
    ids = torch.full((len(rows), max(map(len, rows))), pad)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):                      # left padding, as transformers pads for generation
        ids[b, ids.shape[1] - len(r):] = torch.tensor(r)
        mask[b, ids.shape[1] - len(r):] = 1
    return ids, mask


@pytest.fixture(scope="module")
def hf_models(exports):
    from transformers import AutoModelForCausalLM

    return {n: AutoModelForCausalLM.from_pretrained(str(e[3]), trust_remote_code=True).eval()
            for n, e in exports.items()}


CASES = ([("setdlm", kind, {"window": W, "tau": tau}) for W in (1, 4) for tau in (0.5, 1e6)
          for kind in TEXTS]
         + [(m, kind, {}) for m in ("ar", "bd3lm", "mdlm") for kind in TEXTS]
         + [("setdlm_shift", kind, {"window": 4, "tau": 0.5}) for kind in TEXTS]
         + [(m, kind, {}) for m in ("bd3lm_shift", "mdlm_shift") for kind in ("prompt", "infill")]
         + [("setdlm_shift", kind, {"window": 4, "tau": t, "commit_rule": "leftmost"}) for kind in TEXTS
            for t in (0.5, 1e6)]
         + [("bd3lm_shift", "prompt", {"tau": 0.5, "commit_rule": "leftmost"}),
            ("setdlm", "infill", {"window": 4, "tau": 0.7, "commit_rule": "leftmost"})]
         + [("setdlm", "prompt", {"temperature": 1.0, "top_p": 0.9, "seed": 5, "window": 4, "tau": 0.7}),
            ("bd3lm", "prompt", {"temperature": 0.8, "seed": 2}),
            ("setdlm", "prompt", {"repetition_penalty": 1.3, "window": 2})])


@pytest.mark.parametrize("method,kind,options", CASES, ids=[f"{m}-{k}-{o}" for m, k, o in CASES])
def test_export_generate_equals_native_sampler(exports, hf_models, tokenizer, method, kind, options):
    rows = _ids(tokenizer, kind)
    options = {"max_new_tokens": 40, "stop_at_eos": False, **options}
    native, nfe = _native(exports[method], tokenizer, rows, options)
    ids, mask = _batch(rows, tokenizer.pad)
    out = hf_models[method].generate(ids, attention_mask=mask, **options)
    assert out.generated == native
    assert out.nfe == nfe
    if kind != "infill":
        assert len(native[0]) == 40 and len(set(native[0])) > 3     # decoded past L, not a constant output


def test_stop_strings_with_the_exported_tokenizer(exports, hf_models, tokenizer):
    from transformers import AutoTokenizer

    rows = _ids(tokenizer, "prompt")
    hf_tok = AutoTokenizer.from_pretrained(str(exports["setdlm"][3]), trust_remote_code=True)
    native, _ = _native(exports["setdlm"], tokenizer, rows, {"max_new_tokens": 30, "stop_at_eos": False})
    stop = tokenizer.decode(native[0][6:8])                  # a string the first row produces
    opts = {"max_new_tokens": 30, "stop_at_eos": False, "stop_strings": (stop,)}
    expected, _ = _native(exports["setdlm"], tokenizer, rows, opts)
    ids, mask = _batch(rows, tokenizer.pad)
    out = hf_models["setdlm"].generate(ids, attention_mask=mask, tokenizer=hf_tok, **opts)
    assert out.generated == expected and len(expected[0]) < 30


def test_defaults_come_from_generation_config_and_infill_helper(exports, hf_models, tokenizer):
    d = exports["setdlm"][3]
    saved = json.loads((d / "generation_config.json").read_text())
    assert (saved["window"], saved["context_length"], saved["do_sample"]) == (2, L, False)
    model = hf_models["setdlm"]
    rows = _ids(tokenizer, "prompt")[:1]
    native, _ = _native(exports["setdlm"], tokenizer, rows, {"max_new_tokens": 12})
    assert model.generate(torch.tensor(rows), max_new_tokens=12).generated == native
    assert model.generate(torch.tensor([rows[0][1:]]), max_new_tokens=12).generated == native   # BOS prepended
    p, s, m = TEXTS["infill"][0]
    filled = model.infill(tokenizer.encode(p), tokenizer.encode(s), m)
    assert filled.generated == _native(exports["setdlm"], tokenizer, _ids(tokenizer, "infill")[:1], {})[0]
    assert "model.generate" in (d / "README.md").read_text()


def test_bf16_export_decodes(exports, tokenizer, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from setdiff_mega.checkpoint import convert

    model, _, cfg, d = exports["setdlm"]
    out = convert.export(d.parent / "native", tmp_path / "bf16", dtype="bf16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    m = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.bfloat16).eval()
    got = m.generate(torch.tensor(_ids(tokenizer, "prompt")[:1]), max_new_tokens=10, stop_at_eos=False)
    assert len(got.generated[0]) == 10
    assert m._setdiff_prepared.format == "fp32"               # auto: bfloat16 weights decode in their own dtype


STANDALONE = """
import json, sys
sys.modules["setdiff_mega"] = None          # neither this package nor megatron-core may be imported
sys.modules["megatron"] = None
import torch
from transformers import AutoModelForCausalLM
d, rows = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
out = model.generate(torch.tensor(rows), max_new_tokens=20, stop_at_eos=False, window=4, tau=0.5,
                     decode_weights="fp32")
packed = model.generate(torch.tensor(rows), max_new_tokens=20, stop_at_eos=False, window=4, tau=0.5)   # auto
default = model._setdiff_prepared.format
loaded = sorted(m for m in sys.modules if m.startswith(("setdiff", "megatron")))
kernels = [m for m in sys.modules if m.endswith(".cpu_kernels")]
built = [sys.modules[m].library() is not None for m in kernels]
sources = [str(sys.modules[m].source_path()) for m in kernels]
print(json.dumps({"tokens": out.generated, "packed": packed.generated, "modules": loaded, "kernels": kernels,
                  "built": built, "sources": sources, "default": default}))
"""


def test_export_loads_and_decodes_without_setdiff_mega(exports, tokenizer, tmp_path):
    d = exports["setdlm"][3]
    rows = _ids(tokenizer, "prompt")[:1]
    expected, _ = _native(exports["setdlm"], tokenizer, rows,
                          {"max_new_tokens": 20, "stop_at_eos": False, "window": 4, "tau": 0.5})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), SETDIFF_KERNEL_DIR=str(tmp_path / "k"))
    r = subprocess.run([sys.executable, "-c", STANDALONE, str(d), json.dumps(rows)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tokens"] == expected
    assert got["packed"] == expected                          # fp32-packed: the export's own copy of the kernels
    assert got["default"] == "fp32-packed"                    # generate()'s default, auto, on a CPU
    assert len(got["kernels"]) == 1
    assert got["sources"] == [str(d / "cpu_kernels.cpp")]                  # built from the export's copy
    assert (d / "cpu_kernels.cpp").read_text() == (Path(__file__).parents[2] / "setdiff_mega/hfmodel/cpu_kernels.cpp"
                                                  ).read_text()
    from setdiff_mega.hfmodel.cpu_kernels import _compiler
    assert got["built"] == [_compiler() is not None], r.stderr[-3000:]
    assert [m for m in got["modules"] if m not in ("setdiff_mega", "megatron")] == []


def _broken(src: Path, dst: Path, what: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    (dst / "SHA256SUMS").unlink()       # edited on purpose, or older than checksums: the structure is checked
    if what == "weights":
        (dst / "model.safetensors").unlink()
    elif what == "config":
        c = json.loads((dst / "config.json").read_text())
        c["intermediate_size"] = c["intermediate_size"] * 2
        (dst / "config.json").write_text(json.dumps(c))
    else:
        t = json.loads((dst / "tokenizer.json").read_text())
        t["added_tokens"] = [a for a in t["added_tokens"] if a["content"] != "<|mask|>"]
        (dst / "tokenizer.json").write_text(json.dumps(t))
    return dst


@pytest.mark.parametrize("what,message", [("weights", "model.safetensors is missing"),
                                          ("config", "the weights do not match config.json"),
                                          ("tokenizer", "tokenizer.json has no MASK token")])
def test_bad_export_directory_fails_at_load_with_one_clear_error(exports, tmp_path, what, message):
    from transformers import AutoModelForCausalLM

    d = _broken(exports["setdlm"][3], tmp_path / what, what)
    with pytest.raises(ValueError, match=message) as e:
        AutoModelForCausalLM.from_pretrained(str(d), trust_remote_code=True)
    assert str(d) in str(e.value) and "convert_checkpoint.py to-hf" in str(e.value)


def test_decode_step_computes_the_model_forward_and_follows_weight_updates(hf_models):
    """The flat decode forward over fused weights equals SetDLMForDiffusionLM.forward (1e-5), and a
    parameter changed in place is picked up (the fused copies are rebuilt)."""
    from setdiff_mega.hfmodel.generation_setdlm import DecodeModel

    model = hf_models["bd3lm"]
    dm = DecodeModel(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (2, 9), generator=g)
    pos = torch.arange(9).expand(2, 9) + 3
    keep = torch.rand(2, 9, 9, generator=g) > 0.4
    keep |= torch.eye(9, dtype=torch.bool)
    with torch.no_grad():
        ref = model(tokens, position_ids=pos, attention_mask=keep, logits_start=4).logits
        assert torch.allclose(dm(tokens, pos, keep, 4), ref, atol=1e-5)
        first, w = dm.weights(), model.model.layers[0].self_attn.k_proj.weight
        saved = w.clone()
        w.mul_(1.5)
        changed = model(tokens, position_ids=pos, attention_mask=keep, logits_start=4).logits
        assert torch.allclose(dm(tokens, pos, keep, 4), changed, atol=1e-5) and dm.weights() is not first
        w.copy_(saved)


@pytest.mark.parametrize("kind,W", [("prompt", 4), ("infill", 4), ("prompt", 1)])
def test_static_shapes_decode_the_same_tokens_with_one_step_signature(exports, hf_models, tokenizer, kind, W):
    """``static_shapes``: the chunks padded to W pending + W query rows and the cache at fixed addresses give
    the same tokens (export and native path, past L: evictions), and every decode step after the prefill
    has one signature (shapes, strides, cache address), what a CUDA graph needs (capture.py)."""
    from dataclasses import replace

    from setdiff_mega.decoding.base import Canvas
    from setdiff_mega.decoding.setdlm import SetDLMSampler
    from setdiff_mega.hfmodel.generation_setdlm import DecodeModel, options

    rows = _ids(tokenizer, kind)
    opts = {"max_new_tokens": 40, "stop_at_eos": False, "window": W, "tau": 0.5}
    ids, mask = _batch(rows, tokenizer.pad)
    model = hf_models["setdlm"]
    dynamic = model.generate(ids, attention_mask=mask, **opts)
    static = model.generate(ids, attention_mask=mask, static_shapes=True, **opts)
    assert static.generated == dynamic.generated and static.nfe == dynamic.nfe
    assert _native(exports["setdlm"], tokenizer, rows, {**opts, "static_shapes": True})[0] == dynamic.generated
    dm, c = DecodeModel(model, L), model.config
    cfg = replace(options(model, {**opts, "static_shapes": True}), context_length=L)
    out = SetDLMSampler(dm, c.method["mask_token_id"], c.pad_token_id, c.eos_token_id, cfg).generate(
        Canvas.from_prompts(rows, c.method["mask_token_id"], c.pad_token_id, cfg.max_new_tokens))
    assert out.tokens == dynamic.generated and out.evicted > 0
    assert dm.captured.steady_signatures() == 1 and len(dm.captured.signatures) == 2     # steps + the prefill
    assert sum(dm.captured.signatures.values()) == out.nfe


def test_step_breakdown_times_the_forwards_and_the_samplers_own_work(exports, hf_models, tokenizer):
    """``tools/bench_generate.py``'s split of a decode step (benchmark.step_breakdown): the timing wrapper
    changes no token, and the decode with stubbed forwards takes as many steps (one token per step, no
    EOS stop, past L: evictions)."""
    from setdiff_mega.hfmodel.generation_setdlm import DecodeModel
    from setdiff_mega.inference import GenerationConfig
    from setdiff_mega.inference.benchmark import TimedModel, _tokens, step_breakdown

    engines = {"native": exports["setdlm"][0], "plain": DecodeModel(hf_models["setdlm"], L)}
    cfg = GenerationConfig(max_new_tokens=40, window=2, tau=1e6, stop_at_eos=False, context_length=L)
    prompts = TEXTS["prompt"][:1]
    for m in engines.values():
        assert _tokens(TimedModel(m), tokenizer, "setdlm", prompts, cfg) == _tokens(m, tokenizer, "setdlm",
                                                                                    prompts, cfg)
    split = step_breakdown(engines, tokenizer, "setdlm", prompts, cfg, repeats=1)
    for b in split.values():
        assert b["calls"] == b["stub_calls"] == 41                  # the prefill + 40 one-token steps
        assert 0 < b["forward_ms"] < b["step_ms"] and b["sampler_ms"] > 0


def test_compare_settings_measures_each_variant_and_checks_their_tokens(exports, tokenizer):
    """``tools/bench_generate.py``'s trace cost (benchmark.compare_settings): record off / on are both measured
    and decode identical tokens; variants that change the tokens (W 1 vs 4 at tau 0.5) are reported as such."""
    from setdiff_mega.inference import GenerationConfig
    from setdiff_mega.inference.benchmark import compare_settings

    cfg = GenerationConfig(max_new_tokens=16, window=4, tau=0.5, stop_at_eos=False, context_length=L)
    cases = [("setdlm", "setdlm", TEXTS["prompt"][:1], cfg)]
    (row,) = compare_settings(exports["setdlm"][0], tokenizer, cases, {"off": {"record": False},
                                                                     "on": {"record": True}}, repeats=2)
    assert row["identical_tokens"] and row["off_tokens_per_s"] > 0 and row["on_tokens_per_s"] > 0
    assert row["speedup"] == pytest.approx(row["on_tokens_per_s"] / row["off_tokens_per_s"])
    (row,) = compare_settings(exports["setdlm"][0], tokenizer, cases, {"W1": {"window": 1}, "W4": {}}, repeats=1)
    assert not row["identical_tokens"]


@pytest.mark.parametrize("method,options", [("setdlm", {"window": 4, "tau": 0.5}), ("ar", {}), ("bd3lm", {}),
                                            ("mdlm", {}), ("setdlm_shift", {"window": 4, "tau": 0.9})])
def test_the_export_records_the_native_engines_decoding_trace(exports, hf_models, tokenizer, method, options):
    """record=True: the export's ``generate`` returns each row's trace (decoding/trace.py), equal to the native
    sampler's (confidences to 1e-4: two forward implementations), and replaying it gives the generated tokens."""
    from setdiff_mega.decoding.trace import DecodeTrace, traces
    from setdiff_mega.inference import Canvas, build_sampler
    from setdiff_mega.inference.options import generation_config

    rows = _ids(tokenizer, "prompt") + _ids(tokenizer, "infill")
    options = {"max_new_tokens": 24, "stop_at_eos": False, "record": True, **options}
    model, objective, cfg, _ = exports[method]
    gc = generation_config(cfg.objective, cfg.data.seq_length, overrides=options)
    canvas = Canvas.from_prompts(rows, tokenizer.mask, tokenizer.pad, gc.max_new_tokens)
    native = traces(objective.name, canvas, build_sampler(objective, model, tokenizer, gc).generate(canvas), gc)
    ids, mask = _batch(rows, tokenizer.pad)
    out = hf_models[method].generate(ids, attention_mask=mask, **options)
    got = [DecodeTrace(**t) for t in out.trace]
    assert len(got) == len(native)
    for a, b in zip(got, native):            # the same commits; confidences equal up to the engines' float noise
        assert a.confidences == pytest.approx(b.confidences, abs=1e-4)
        a.confidences = b.confidences
    assert got == native
    for t, gen in zip(native, out.generated):
        assert t.replay()[-1] == gen and t.num_steps > 1
