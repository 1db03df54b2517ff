"""Tools that write never destroy or replace what they did not create (issue 28, the rule for every tool):
each writing tool is pointed at its own input, at a parent of it, and at a non-empty directory of the
user's; it refuses with one line before any work, and every file of the user's is still there, unchanged.
Then the two conversions that used to delete or replace data (defects 1 and 2), on a real run."""
import json
import shutil

import pytest
import yaml

from .conftest import ROOT, kept, run_main, snapshot


@pytest.fixture
def user(tmp_path, data_dir):
    """A user's directory: a run, an export, a dataset with its tokenizer and raw text, tasks, prompts, notes."""
    u = tmp_path / "user"
    (u / "run" / "checkpoints" / "step_0000001").mkdir(parents=True)
    (u / "run" / "checkpoints" / "step_0000001" / "state.json").write_text("{}")
    (u / "export").mkdir()
    (u / "export" / "config.json").write_text(json.dumps({"model_type": "setdlm"}))
    (u / "qwen").mkdir()                       # a Hugging Face family's model (issue 30's import)
    (u / "qwen" / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    shutil.copytree(data_dir, u / "data", ignore=shutil.ignore_patterns("cache"))
    (u / "data" / "raw.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(20)))
    (u / "prompts.txt").write_text("Question: 1 + 1?\n")
    (u / "stuff").mkdir()
    (u / "stuff" / "keep.txt").write_text("mine")
    (u / "notes.txt").write_text("notes")
    grid = {"name": "g", "base_config": str(ROOT / "configs/tiny_cpu.yaml"), "objectives": ["ar"], "seeds": [0],
            "overrides": [f"data.path={u / 'data' / 'corpus'}"], "models": [{"num_layers": 1}], "tokens": [64],
            "global_batch_size": 4}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))      # the user's data is the sweep's input
    return u


def _grid_at(u, out):
    f = u.parent / "grid.yaml"
    f.write_text(yaml.safe_dump({**yaml.safe_load(f.read_text()), "out_dir": str(out)}))
    return [f]


# (tool, argv builder (user dir, output path) -> argv, output as the input, as the input's parent, a non-empty dir)
CASES = {
    "to-hf": ("convert_checkpoint", lambda u, o: ["to-hf", u / "run", o], "run", ".", "stuff"),
    "from-hf": ("convert_checkpoint", lambda u, o: ["from-hf", u / "export", o], "export", ".", "stuff"),
    "from-hf-family": ("convert_checkpoint", lambda u, o: ["from-hf", u / "qwen", o, "--objective", "setdlm"], "qwen",
                       ".", "stuff"),
    "to-hf-format-hf": ("convert_checkpoint", lambda u, o: ["to-hf", u / "run", o, "--format", "hf"], "run", ".",
                        "stuff"),
    "preprocess": ("preprocess_data", lambda u, o: ["--input", u / "data/raw.jsonl", "--tokenizer",
                                                    u / "data/tokenizer.json", "--output-prefix", o, "--no-progress"],
                   "data/corpus", "data", "stuff"),
    "merge": ("preprocess_data", lambda u, o: ["--merge", u / "data/corpus", "--output-prefix", o],
              "data/corpus", "data", "stuff"),
    "prepare": ("prepare_data", lambda u, o: ["--input", u / "data/raw.jsonl", "--out", o], "data/raw.jsonl",
                "data", "stuff"),
    "tokenizer": ("train_tokenizer", lambda u, o: ["--from-tokenizer", u / "data/tokenizer.json", "--bos", "<|bos|>",
                                                   "--eos", "<|eos|>", "--out", o], "data", None, None),
    "generate": ("generate", lambda u, o: ["--checkpoint", u / "run", "--file", u / "prompts.txt", "--out", o],
                 "prompts.txt", ".", "stuff"),
    "evaluate": ("evaluate", lambda u, o: ["--checkpoint", u / "run", "--text", u / "prompts.txt", "--no-tasks",
                                           "--out", o], "prompts.txt", ".", "stuff"),
    "sweep": ("sweep", lambda u, o: _grid_at(u, o), "data", ".", "stuff"),
    "reproduce": ("reproduce", lambda u, o: ["--toy", "--data", u / "data/corpus", "--tasks", u / "data/tasks",
                                             "--out", o, "--report", u / "report.md"], "data/tasks", ".", "stuff"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_writing_tool_pointed_at_its_input_a_parent_or_a_users_directory_refuses_and_keeps_everything(
        user, capsys, name):
    tool, argv, *targets = CASES[name]
    before = snapshot(user)
    for target in targets:
        if target is None:
            continue
        rc, err = run_main(capsys, tool, argv(user, user / target))
        assert rc == 2, (name, target, err[-2000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (name, target, err)
        out = user / target
        assert f"'{out}" in err or f"'{out.resolve()}" in err, (name, target, err)    # the output rule refused it
        kept(before, user)


def test_to_hf_into_the_runs_directory_deletes_nothing_and_overwrite_replaces_only_an_export(
        trained_run, tmp_path, capsys):
    """Defect 1: `to-hf runs/exp1 runs` deleted the source run, its siblings and every file in runs/."""
    save, _ = trained_run
    runs = tmp_path / "runs"
    shutil.copytree(save, runs / "exp1")
    (runs / "exp2").mkdir()
    (runs / "exp2" / "metrics.jsonl").write_text("{}\n")
    (runs / "notes.txt").write_text("mine")
    before = snapshot(runs)
    for out in (runs, runs / "exp1", runs / "exp2"):
        for extra in ([], ["--overwrite"]):
            rc, err = run_main(capsys, "convert_checkpoint", ["to-hf", runs / "exp1", out, *extra])
            assert rc == 2 and err.startswith("error: out_dir"), err
    kept(before, runs)
    rc, err = run_main(capsys, "convert_checkpoint", ["to-hf", runs / "exp1", tmp_path / "export"])
    assert rc == 0, err
    rc, err = run_main(capsys, "convert_checkpoint", ["to-hf", runs / "exp1", tmp_path / "export"])
    assert rc == 2 and "pass --overwrite" in err
    rc, err = run_main(capsys, "convert_checkpoint", ["to-hf", runs / "exp1", tmp_path / "export", "--overwrite"])
    assert rc == 0, err
    assert (tmp_path / "export" / "SHA256SUMS").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]     # no staging left behind
    kept(before, runs)


def test_from_hf_never_replaces_a_training_run(trained_run, tmp_path, capsys):
    """Defect 2: `from-hf EXPORT runs/x` replaced run x's training checkpoint with a weights-only one."""
    save, _ = trained_run
    run = tmp_path / "run"
    shutil.copytree(save, run)
    rc, err = run_main(capsys, "convert_checkpoint", ["to-hf", run, tmp_path / "export"])
    assert rc == 0, err
    before = snapshot(run)
    for extra in ([], ["--overwrite"], ["--overwrite", "--step", "3"]):
        rc, err = run_main(capsys, "convert_checkpoint", ["from-hf", tmp_path / "export", run, *extra])
        assert rc == 2 and "holds a training run" in err, err
    kept(before, run)
    assert set(snapshot(run)) == set(before)
    rc, err = run_main(capsys, "convert_checkpoint", ["from-hf", tmp_path / "export", tmp_path / "imp"])
    assert rc == 0, err
    rc, err = run_main(capsys, "convert_checkpoint", ["from-hf", tmp_path / "export", tmp_path / "imp"])
    assert rc == 2 and "pass --overwrite" in err
    rc, err = run_main(capsys, "convert_checkpoint", ["from-hf", tmp_path / "export", tmp_path / "imp", "--overwrite",
                                                      "--step", "5"])
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "imp" / "checkpoints").glob("step_*")) == ["step_0000005"]
