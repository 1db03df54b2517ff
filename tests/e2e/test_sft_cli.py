"""Supervised fine-tuning end to end on tiny data: the embedded math problems as prompt / response records ->
``tools/preprocess_data.py --sft`` -> training with ``data.format=sft`` (the prompt as context) under SetDLM
and AR, padded and packed (data.packing), with validation on held-out conversations; bad records and a
pretraining dataset are one line."""
import json

import pytest

from .conftest import ROOT, TINY, run_here


@pytest.fixture(scope="module")
def sft_data(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    rows = [json.loads(line) for line in (data_dir / "tasks" / "math.jsonl").read_text().splitlines()]
    records = [{"prompt": f"Question: {r['question']}\n", "response": f"Answer: {r['solution']}\n#### {r['answer']}"}
               for r in rows]
    (out / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r = run_here(["tools/preprocess_data.py", "--sft", "--input", out / "math.jsonl", "--tokenizer",
                  data_dir / "tokenizer.json", "--output-prefix", out / "sft" / "math", "--no-progress"])
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("objective,L,packing", [("setdlm", 128, False), ("ar", 128, False), ("setdlm", 384, True)])
def test_training_on_conversations(sft_data, data_dir, tmp_path, objective, L, packing):
    from setdiff_mega.config import load_config
    from setdiff_mega.training import train

    opts = [o for o in TINY if not o.startswith("data.seq_length")]
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [
        *opts, f"data.seq_length={L}", f"data.path={sft_data / 'sft' / 'math'}", "data.format=sft",
        f"data.tokenizer={data_dir / 'tokenizer.json'}", "data.split=90,10,0", "train.train_steps=4",
        f"objective.name={objective}", f"train.save_dir={tmp_path / 'run'}", f"data.packing={packing}"])
    notes = []
    res = train(cfg, log=lambda *a, **k: notes.append(" ".join(map(str, a))))
    losses = [r["train/loss"] for r in res.history if "train/loss" in r]
    assert res.final_step == 4 and all(0 < v < 20 for v in losses) and res.final_val_loss > 0
    packed = [n for n in notes if n.startswith("packing: ")]
    assert len(packed) == packing and (not packing or " train conversations in " in packed[0])


def test_bad_input_is_one_line(sft_data, data_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"messages": []}) + "\n")
    r = run_here(["tools/preprocess_data.py", "--sft", "--input", bad, "--tokenizer", data_dir / "tokenizer.json",
                  "--output-prefix", tmp_path / "o" / "x", "--no-progress"])
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert f"{bad}:2: 'messages' must be a non-empty list" in r.stderr
    assert not list((tmp_path / "o").glob("x*"))

    from setdiff_mega.config import load_config
    from setdiff_mega.data.indexed import DataError
    from setdiff_mega.training import train

    for fmt, path, message in [("sft", data_dir / "corpus", "is not supervised data .*--sft"),
                               ("pretrain", sft_data / "sft" / "math", "is supervised data .*data.format=sft")]:
        cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*TINY, f"data.path={path}", f"data.format={fmt}",
                                                           f"data.tokenizer={data_dir / 'tokenizer.json'}",
                                                           f"train.save_dir={tmp_path / fmt}", "train.train_steps=1"])
        with pytest.raises(DataError, match=message):
            train(cfg, log=lambda *a, **k: None)
