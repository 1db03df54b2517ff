"""The side-by-side benchmark against the reference (tools/bench_reference.py, issue 44) without the reference's
environment: the interleaving and the report on stand-in runners; the worker protocol end to end with the worker
decoding through this project's engine (``--self``) on a tiny DiT; the one-line errors. With the reference set
up (scripts/setup_reference.sh; SETDIFF_REF_DIR naming its work tree) a slow test decodes with the reference
itself and checks the tokens agree."""
import io
import json
import os
from pathlib import Path

import pytest

from setdiff_mega.errors import ConfigError
from setdiff_mega.inference import reference_bench as rb
from setdiff_mega.inference import reference_worker

TINY = rb.Shape(layers=2, hidden=32, heads=4, vocab=300, length=64, D=2)
ROOT = Path(__file__).resolve().parents[2]


def test_rounds_alternate_the_order_and_the_report_compares_each_side_to_the_reference():
    calls = []

    def side(name, tokens, seconds, nfe):
        def fn(prompt):
            calls.append(name)
            return {"tokens": tokens(prompt), "seconds": seconds, "nfe": nfe}
        return fn

    runners = {"ours": side("ours", lambda p: [p[0], 7, 8], 0.5, 4),
               "reference": side("reference", lambda p: [p[0], 7, 9], 1.0, 4)}
    row = rb.compare_setting(runners, [[1], [2]], rounds=3)
    assert calls[:2] == ["ours", "reference"]                             # one untimed warm-up decode each
    assert row["order"] == ["ours", "reference", "reference", "ours", "ours", "reference"]
    assert row["ours"]["tokens_per_s"] == pytest.approx(6.0) and row["reference"]["tokens_per_s"] == pytest.approx(3.0)
    assert row["ours"]["ms_per_forward"] == pytest.approx(125.0)          # 2 x 0.5 s over 2 x 4 forwards
    assert row["ours"]["tokens_per_step"] == pytest.approx(1.0)           # 6 tokens over 2 x (4 - 1 prefill)
    assert row["ours_over_reference"] == {"tokens_per_s": pytest.approx(2.0), "ms_per_forward": pytest.approx(0.5)}
    agree = row["ours_agreement"]
    assert agree["fraction"] == pytest.approx(4 / 6) and not agree["identical"]
    assert agree["first_difference"] == {"prompt": 0, "position": 2}
    assert row["ours"]["deterministic"] and len(row["ours"]["rounds"]) == 3
    assert rb.agreement([[1, 2], [3]], [[1, 2], [3, 4]])["fraction"] == pytest.approx(3 / 4)


def test_the_worker_protocol_with_this_engine_in_the_worker(mcore, tmp_path):
    """The whole run with the worker decoding through this project's engine: both sides must agree exactly."""
    ticks = []
    report = rb.run(tmp_path, TINY, self_test=True, taus=(1e6, 0.9), windows=(4,), rounds=2, num_prompts=2,
                    prompt_length=6, max_new_tokens=12, say=lambda s: None, tick=ticks.append)
    assert json.loads((tmp_path / "reference.json").read_text()) == json.loads(json.dumps(report))
    assert "ms/fwd/ref" in (tmp_path / "reference.txt").read_text()
    assert report["reference"]["side"] == "self" and report["threads"] == 1 and report["reference"]["threads"] == 1
    assert [len(p) for p in report["prompts"]] == [6, 6]
    loose, strict = report["settings"]
    assert (loose["window"], loose["tau"], strict["tau"]) == (4, 1e6, 0.9)
    assert loose["order"] == ["ours", "reference", "reference", "ours"] and "ours_reference_k" not in loose
    assert strict["order"] == ["ours", "reference", "ours_reference_k", "ours_reference_k", "reference", "ours"]
    assert ticks == loose["order"] + strict["order"]
    assert loose["ours"]["nfe_per_decode"] == 13 and loose["ours"]["tokens_per_step"] == 1.0    # prefill + 12 steps
    for row in (loose, strict):
        assert row["ours_agreement"]["identical"] and row["ours_agreement"]["fraction"] == 1.0
        assert row["ours"]["nfe_per_decode"] == row["reference"]["nfe_per_decode"]
        for key in ("tokens_per_s", "ms_per_forward"):
            assert row["ours_over_reference"][key] > 0
    assert strict["ours"]["tokens_per_step"] > 1.0            # the head's scale lets confidences pass tau 0.9
    assert strict["ours_reference_k"]["nfe_per_decode"] <= strict["ours"]["nfe_per_decode"]


def test_the_release_is_written_once_and_its_tensors_follow_the_seed(tmp_path):
    said = []
    d = rb.ensure_release(tmp_path / "release", TINY, 0, 8.0, said.append)
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    rb.ensure_release(tmp_path / "release", TINY, 0, 8.0, said.append)
    assert said[1].startswith("reusing") and (d / "model.safetensors").stat().st_mtime_ns == stamp
    config = json.loads((d / "config.json").read_text())
    assert config["mask_token_id"] == TINY.vocab - 1 and config["noise_config"]["max_block_size"] == 2 * TINY.D
    a, b = rb.release_tensors(TINY, 0, 8.0), rb.release_tensors(TINY, 0, 8.0)
    assert all((a[k] == b[k]).all() for k in a) and a["backbone.blocks.1.attn_qkv.weight"].shape == (96, 32)
    assert rb.prompts_for(TINY, 2, 5, 0) == rb.prompts_for(TINY, 2, 5, 0)
    assert all(0 < t < TINY.vocab - 1 for p in rb.prompts_for(TINY, 3, 20, 1) for t in p)


def test_bad_input_gives_one_line(tmp_path):
    with pytest.raises(ConfigError, match="--ref-dir is required .*scripts/setup_reference.sh"):
        rb.check_reference(None, ".venv-ref")
    with pytest.raises(ConfigError, match="--ref-dir .* is not a setdlms work tree .*scripts/setup_reference.sh"):
        rb.check_reference(str(tmp_path), str(tmp_path / "venv"))
    ref = tmp_path / "ref"
    (ref / "src" / "denoiser").mkdir(parents=True)
    (ref / "src" / "denoiser" / "setdlm.py").write_text("")
    with pytest.raises(ConfigError, match=r"--ref-venv .* run scripts/setup_reference.sh"):
        rb.check_reference(str(ref), str(tmp_path / "venv"))
    with pytest.raises(ConfigError, match="--shape 'small' must be gpt2, main or"):
        rb.parse_shape("small")
    with pytest.raises(ConfigError, match="multiple of heads"):
        rb.parse_shape("2,30,4,300,64,2")
    main = rb.parse_shape("main", ROOT / "configs" / "tiny_cpu.yaml")
    assert (main.layers, main.hidden, main.heads, main.length, main.D) == (4, 160, 5, 128, 4)
    with pytest.raises(ConfigError, match="must be >= 2 and fit L = 64"):
        rb.run(tmp_path / "out", TINY, self_test=True, prompt_length=60, max_new_tokens=8, say=lambda s: None)
    with pytest.raises(ConfigError, match="--taus .* W >= 1"):
        rb.check_options(TINY, (0.9,), (0,), 1, 1, 4, 4)
    assert not (tmp_path / "out").exists()


def test_the_worker_answers_a_failed_request_with_one_line():
    class Side:
        info = {"side": "stub"}

        def generate(self, prompt, max_new_tokens, window, tau):
            if not prompt:
                raise ValueError("empty prompt\nsecond line")
            return {"tokens": prompt[:max_new_tokens], "seconds": 0.0, "nfe": 1}

    out = io.StringIO()
    lines = [json.dumps({"prompt": [], "max_new_tokens": 2, "window": 4, "tau": 0.9}), "",
             json.dumps({"prompt": [5, 6, 7], "max_new_tokens": 2, "window": 4, "tau": 0.9}),
             json.dumps({"quit": True}), json.dumps({"prompt": [1], "max_new_tokens": 1, "window": 1, "tau": 1})]
    reference_worker.serve(Side(), io.StringIO("\n".join(lines) + "\n"), out)
    ready, failed, ok = (json.loads(x) for x in out.getvalue().splitlines())
    assert ready["ready"] and ready["side"] == "stub"
    assert failed == {"error": "ValueError: empty prompt"}
    assert ok["tokens"] == [5, 6]


@pytest.mark.slow
def test_the_reference_itself_gives_the_same_tokens(mcore, tmp_path):
    """Needs scripts/setup_reference.sh REF_DIR (.venv-ref) and SETDIFF_REF_DIR=REF_DIR."""
    ref, venv = os.environ.get("SETDIFF_REF_DIR"), ROOT / ".venv-ref"
    if not ref or not (venv / "bin" / "python").is_file():
        pytest.skip("the reference is not set up: scripts/setup_reference.sh REF_DIR and SETDIFF_REF_DIR=REF_DIR")
    report = rb.run(tmp_path, TINY, ref_dir=ref, ref_venv=str(venv), taus=(1e6, 0.9), windows=(8,), rounds=1,
                    num_prompts=2, prompt_length=8, max_new_tokens=16, say=lambda s: None)
    loose, strict = report["settings"]
    assert report["reference"]["transformers"] == "4.52.4"
    assert loose["ours_agreement"]["identical"]                         # tau >= 1: one token per step on both
    assert strict["ours_reference_k_agreement"]["identical"]            # tau < 1: the reference's k schedule
    assert strict["reference"]["nfe_per_decode"] == strict["ours_reference_k"]["nfe_per_decode"]
