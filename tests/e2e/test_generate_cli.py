"""tools/generate.py and the generation API on a checkpoint saved by the pretraining CLI."""
import json

import pytest

from .conftest import _run, run_here


def test_generate_cli_prompts_infill_and_jsonl(trained_run, tmp_path):
    save, _ = trained_run
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Question:"}) + "\n" +
                       json.dumps({"prefix": "Ava was a baker.", "suffix": " She felt proud.", "span": 5}) + "\n")
    out = tmp_path / "out.jsonl"
    r = run_here(["tools/generate.py", "--checkpoint", str(save), "--file", str(prompts), "--out", str(out),
              "--max-new-tokens", "12", "--tau", "0.5"])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2
    assert all(k in rows[0] for k in ("text", "tokens_per_s", "nfe", "tokens_per_step", "num_tokens"))
    assert 0 < rows[0]["num_tokens"] <= 12
    assert rows[1]["infill"] and rows[1]["num_tokens"] == 5
    assert rows[1]["sequence"].startswith("<|bos|>Ava was a baker.") and rows[1]["sequence"].endswith(
        " She felt proud.<|eos|>")
    r2 = run_here(["tools/generate.py", "--checkpoint", str(save), "--prompt", "Question:", "--max-new-tokens", "6",
               "--no-cache"])
    assert r2.returncode == 0 and "--- [setdlm, prompt] 6 tokens in" in r2.stdout and "tokens/step" in r2.stdout


def test_generate_cli_decodes_the_same_tokens_in_fp32_and_fp32_packed(trained_run, tmp_path):
    """tools/generate.py decodes with the plain-PyTorch twin (unsharded: whichever engine is named, issue 44);
    oneDNN's prepacked fp32 products (--decode-weights fp32-packed) give the same tokens."""
    save, _ = trained_run
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Question:"}) + "\n" + json.dumps({"prompt": "Once"}) + "\n" +
                       json.dumps({"prefix": "Ava was a baker.", "suffix": " She felt proud.", "span": 5}) + "\n")
    texts = {}
    for engine, fmt in (("native", "fp32"), ("auto", "fp32-packed")):
        out = tmp_path / f"{fmt}.jsonl"
        r = run_here(["tools/generate.py", "--checkpoint", str(save), "--file", str(prompts), "--out", str(out),
                  "--max-new-tokens", "40", "--tau", "0.5", "--no-eos-stop", "--engine", engine,
                  "--decode-weights", fmt])
        assert r.returncode == 0, r.stderr[-2000:]
        texts[fmt] = [(x["sequence"], x["nfe"]) for x in map(json.loads, out.read_text().splitlines())]
    assert texts["fp32"] == texts["fp32-packed"] and len(texts["fp32"]) == 3


@pytest.mark.parametrize("args,message,subprocess", [
    (["--prompt", "x " * 200], "is longer than the model's context of 32 tokens", True),
    (["--infill-prefix", "a", "--infill-suffix", "b", "--span", "0"], "infill span must be >= 1", False),
    (["--file", "/nonexistent.txt"], "No such file", False),
    ([], "no prompts", False),
])
def test_generate_cli_bad_requests(trained_run, capsys, args, message, subprocess):
    """Exit code 2 and one line naming the problem; the first case as a real process, the others through
    the same entry point in this process (a CLI start costs seconds)."""
    save, _ = trained_run
    argv = ["--checkpoint", str(save), *args]
    if subprocess:
        r = _run(["tools/generate.py", *argv])
        code, err = r.returncode, r.stderr
    else:
        import runpy

        from setdiff_mega.cli import run_cli

        main = runpy.run_path("tools/generate.py", run_name="generate_cli")["main"]
        code, err = run_cli(main, argv), capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert message in err, err


def test_prompt_context_limits():
    """A prompt may fill the model's context (generation then runs past L with the cache cropped); one
    with more visible tokens than L is refused. Infill masks do not count against L."""
    from setdiff_mega.data import Tokenizer
    from setdiff_mega.inference import RequestError, encode_request

    tok = Tokenizer.train(["a b c d e f g"] * 10, vocab_size=300)
    ids = encode_request(tok, "a b c")
    assert encode_request(tok, "a b c", context=len(ids)) == ids
    with pytest.raises(RequestError, match="3 visible tokens is longer than the model's context of 2"):
        encode_request(tok, "a b", context=2)
    assert encode_request(tok, {"prefix": "a", "suffix": "b", "span": 20}, context=5)


def test_generate_cli_unknown_checkpoint(tmp_path):
    r = run_here(["tools/generate.py", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x"])
    assert r.returncode == 2 and "missing' does not exist" in r.stderr


def test_vocabulary_mismatch_is_refused(trained_run, mcore):
    from setdiff_mega.checkpoint import load_model
    from setdiff_mega.data import Tokenizer
    from setdiff_mega.inference import GenerationConfig, RequestError, generate

    save, _ = trained_run
    model, objective, tok, cfg = load_model(save)
    other = Tokenizer.train(["a b c d e f g"] * 10, vocab_size=300)
    with pytest.raises(RequestError, match=r"tokenizer vocabulary \(\d+\) does not match the model's"):
        generate(model, other, "setdlm", ["x"], GenerationConfig(max_new_tokens=2))


def test_generate_api_all_samplers(trained_run, mcore):
    from setdiff_mega.checkpoint import load_model
    from setdiff_mega.inference import GenerationConfig, generate

    save, _ = trained_run
    model, objective, tok, cfg = load_model(save)
    reqs = ["Question:", {"prefix": "Sam", "suffix": "end.", "span": 3}, "Ben <|mask|><|mask|> now"]
    for method in ("setdlm", "ar", "bd3lm", "mdlm"):
        res = generate(model, tok, method, reqs, GenerationConfig(max_new_tokens=6, block_size=3), context=32)
        assert [r["infill"] for r in res] == [False, True, True]
        assert res[1]["num_tokens"] == 3 and res[2]["num_tokens"] == 2
        assert all(r["nfe"] >= 1 and r["tokens_per_s"] > 0 for r in res)


def test_convert_inspect_and_generate_from_the_hugging_face_export(trained_run, tmp_path):
    """tools/convert_checkpoint.py to-hf / from-hf, tools/inspect_checkpoint.py on both formats, and
    tools/generate.py giving the same greedy text from the native checkpoint and the export."""
    save, _ = trained_run
    hf_dir = tmp_path / "hf"
    r = run_here(["tools/convert_checkpoint.py", "to-hf", str(save), str(hf_dir)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md",
            "modeling_setdlm.py", "generation_setdlm.py", "setdlm.py", "cache.py"} <= {p.name for p in hf_dir.iterdir()}
    assert "fp32" in r.stdout
    r = run_here(["tools/convert_checkpoint.py", "to-hf", str(save), str(tmp_path / "bf16"), "--dtype", "bf16"])
    assert r.returncode == 0 and "bf16" in r.stdout, r.stderr[-2000:]
    sizes = [(d / "model.safetensors").stat().st_size for d in (tmp_path / "bf16", hf_dir)]
    assert sizes[0] < 0.6 * sizes[1]
    outs = []
    for ck in (save, hf_dir):
        r = run_here(["tools/generate.py", "--checkpoint", str(ck), "--prompt", "Question:", "--max-new-tokens", "10"])
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append([line for line in r.stdout.splitlines() if not line.startswith("---")])
    assert outs[0] == outs[1]

    r = run_here(["tools/inspect_checkpoint.py", str(save), "--json", str(tmp_path / "native.json")])
    assert r.returncode == 0, r.stderr[-2000:]
    native = json.loads((tmp_path / "native.json").read_text())
    assert native["step"] == 12 and native["kind"] == "training" and native["optimizer_tensors"] > 0
    assert "step 12" in r.stdout and "output_layer.weight" in r.stdout
    r = run_here(["tools/inspect_checkpoint.py", str(hf_dir), "--json", str(tmp_path / "hf.json")])
    assert r.returncode == 0, r.stderr[-2000:]
    exported = json.loads((tmp_path / "hf.json").read_text())
    assert exported["format"] == "huggingface" and exported["step"] == 12
    assert exported["parameters"] == native["parameters"]

    r = run_here(["tools/convert_checkpoint.py", "from-hf", str(hf_dir), str(tmp_path / "back")])
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_here(["tools/inspect_checkpoint.py", str(tmp_path / "back"), "--json", str(tmp_path / "back.json")])
    back = json.loads((tmp_path / "back.json").read_text())
    assert back["kind"] == "weights" and back["step"] == 12
    strip = lambda rep: [(t["name"], t["sha256"]) for t in rep["tensors"]]  # noqa: E731
    assert strip(back) == strip(native)                   # bit-identical weights after the round trip
    r = run_here(["tools/convert_checkpoint.py", "from-hf", str(save), str(tmp_path / "x")])
    assert r.returncode == 2 and "has no config.json: point at a Hugging Face model directory" in r.stderr


def test_demo_prints_a_non_empty_unconditional_sample(trained_run, data_dir):
    """The main job's samples: the unconditional one follows the OWT protocol (min length before EOS)."""
    save, _ = trained_run
    r = run_here(["tools/generate.py", "--checkpoint", str(save), "--demo", str(data_dir / "tasks"),
              "--max-new-tokens", "24", "--batch-size", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    head = [x for x in r.stdout.splitlines() if x.startswith("--- [setdlm, unconditional]")]
    assert head and int(head[0].split("]")[1].split()[0]) >= 8, r.stdout       # min_new_tokens = 24 // 3


def test_generate_cli_decoding_flags(trained_run):
    save, _ = trained_run
    r = run_here(["tools/generate.py", "--checkpoint", str(save), "--prompt", "Question:", "--max-new-tokens", "40",
              "--repetition-penalty", "1.2", "--length-penalty", "3,1.5", "--stop-repeat", "4", "--min-new-tokens", "2",
              "--fht-cache-order", "--top-p", "0.9", "--stop-confidence", "0.001", "--stop-patience", "3"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--- [setdlm, prompt]" in r.stdout
    bad = run_here(["tools/generate.py", "--checkpoint", str(save), "--prompt", "x", "--length-penalty", "3"])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "length_penalty" in bad.stderr, bad.stderr
