"""Degenerate inputs are refused before any work, with one line and no library noise (issue 28, defect 5
and the minor cases): evaluations that would score nothing, values that make training meaningless, paths
that cannot be written, an export that is incomplete or was corrupted after export."""
import json
import shutil
import sys

import pytest

from .conftest import ROOT, TINY, one_line_error, run_main, run_tool


def test_evaluate_refuses_to_score_nothing(trained_run, tmp_path, capsys):
    """Defect 5: an empty --text gave `NLL 0.0000/token (ppl 1.00, 0 tokens)`, empty task files `math acc
    0.000 ... infill EM 0.000`, and --no-tasks --no-likelihood exited 0 having done nothing."""
    save, _ = trained_run
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in ("math", "stories"):
        (tasks / f"{name}.jsonl").write_text("")
    for argv, needle in ((["--no-tasks", "--text", empty], f"text file '{empty}' holds no documents"),
                         (["--no-likelihood", "--tasks", tasks], f"task file '{tasks / 'math.jsonl'}' holds no "
                                                                 f"examples"),
                         (["--no-tasks", "--no-likelihood"], "leaves nothing to evaluate"),
                         (["--limit", "0"], "--limit must be >= 1")):
        rc, err = run_main(capsys, "evaluate", ["--checkpoint", save, *argv])
        assert rc == 2 and err.strip().splitlines() == [f"error: {err.strip()[7:]}"] and needle in err, err


@pytest.mark.parametrize("override, field", [("train.num_threads=-1", "train.num_threads=-1 must be >= 1"),
                                             ("train.lr=nan", "train.lr=nan is not a finite number"),
                                             ("train.clip_grad=inf", "train.clip_grad=inf is not a finite number"),
                                             ("model.rotary_percent=0", "model.rotary_percent=0.0 must be in (0, 1]")])
def test_meaningless_training_values_name_their_field(override, field):
    from setdiff_mega.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny_cpu.yaml", [override])
    assert field in str(e.value)


def test_a_run_that_cannot_fit_in_memory_is_refused_with_the_estimate(monkeypatch):
    """data.seq_length=100000 was killed by the kernel with no message."""
    from setdiff_mega.config import ConfigError, load_config
    from setdiff_mega.training import memory

    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["data.seq_length=100000"])
    monkeypatch.setattr(memory, "available_bytes", lambda: (24 * 2 ** 30, "of this machine's available memory"))
    with pytest.raises(ConfigError) as e:
        memory.check_memory(cfg, 2048)
    assert "data.seq_length=100000" in str(e.value) and "of this machine's available memory" in str(e.value)
    assert "train.check_memory=false" in str(e.value)
    memory.check_memory(load_config(ROOT / "configs/tiny_cpu.yaml", []), 2048)        # the main job fits


def test_unwritable_paths_are_one_line(data_dir, tmp_path, capsys):
    """save_dir that is a file, an output prefix under a file, preprocessing over an existing dataset."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = run_tool(["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY, f"train.save_dir={afile}",
                  f"data.path={data_dir / 'corpus'}"])
    one_line_error(r, f"train.save_dir '{afile}' is a file")
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"text": "one document"}) + "\n")
    base = ["--input", raw, "--tokenizer", data_dir / "tokenizer.json", "--no-progress", "--workers", "1"]
    rc, err = run_main(capsys, "preprocess_data", [*base, "--output-prefix", afile / "corpus"])
    assert rc == 2 and f"is under '{afile}', which is a file" in err and len(err.strip().splitlines()) == 1
    rc, err = run_main(capsys, "preprocess_data", [*base, "--output-prefix", tmp_path / "d" / "c"])
    assert rc == 0, err
    before = (tmp_path / "d" / "c.bin").read_bytes()
    rc, err = run_main(capsys, "preprocess_data", [*base, "--output-prefix", tmp_path / "d" / "c"])
    assert rc == 2 and "already holds a dataset" in err and "--overwrite" in err
    assert (tmp_path / "d" / "c.bin").read_bytes() == before
    shutil.copy(data_dir / "corpus.bin", tmp_path / "foreign.bin")            # a .bin/.idx pair of another tool
    shutil.copy(data_dir / "corpus.idx", tmp_path / "foreign.idx")
    rc, err = run_main(capsys, "preprocess_data", [*base, "--output-prefix", tmp_path / "foreign", "--overwrite"])
    assert rc == 2 and "was not written by setdiff-mega's preprocessing" in err


def test_generate_errors_are_one_line_without_library_warnings(trained_run, capsys):
    save, _ = trained_run
    rc, err = run_main(capsys, "generate", ["--checkpoint", save, "--prompt", "x", "--batch-size", "0"])
    assert rc == 2 and err == "error: --batch-size must be >= 1 (got 0)\n"
    r = run_tool(["tools/generate.py", "--checkpoint", str(save), "--prompt", "x " * 200])   # fails after the imports
    one_line_error(r, "longer than the model's context of 32 tokens")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_incomplete_or_corrupted_export_says_so(trained_run, tmp_path, capsys):
    """An export missing tokenizer.json suggested preparing data; a bit flipped in model.safetensors decoded
    silently (exports carried no checksums)."""
    import transformers

    from setdiff_mega.checkpoint import CheckpointError, load_model

    save, _ = trained_run
    exp = tmp_path / "exp"
    rc, err = run_main(capsys, "convert_checkpoint", ["to-hf", save, exp])
    assert rc == 0, err
    lines = (exp / "SHA256SUMS").read_text().splitlines()
    assert {x.split("  ")[1] for x in lines} >= {"model.safetensors", "config.json", "tokenizer.json", "integrity.py"}
    notok = tmp_path / "notok"
    shutil.copytree(exp, notok)
    (notok / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json.*the copy is incomplete; copy the whole directory again"):
        load_model(notok)
    flipped = tmp_path / "flipped"
    shutil.copytree(exp, flipped)
    data = bytearray((flipped / "model.safetensors").read_bytes())
    data[-7] ^= 0x10                                          # same size, still parseable
    (flipped / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its SHA-256 in SHA256SUMS"):
        load_model(flipped)
    with pytest.raises(ValueError, match="model.safetensors does not match its SHA-256"):
        transformers.AutoModelForCausalLM.from_pretrained(str(flipped), trust_remote_code=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(flipped), trust_remote_code=True,
                                                              verify_checksums=False)
    assert model is not None                                   # the check can be skipped on purpose
    load_model(exp)


def test_lm_eval_unknown_task_is_one_line(trained_run, capsys, monkeypatch):
    save, _ = trained_run
    monkeypatch.setattr(sys, "argv", ["lm_eval_harness.py", "--model_args", f"checkpoint={save}", "--tasks",
                                      "no_such_task"])
    rc, err = run_main(capsys, "lm_eval_harness", [])
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("error: lm-eval: Tasks not found: no_such_task") and "lm-eval ls tasks" in last
    assert "Traceback" not in err
