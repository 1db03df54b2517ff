"""tools/convert_checkpoint.py with a Hugging Face family's model (a tiny random Qwen3 built with
transformers): from-hf under an objective (the recorded config, the adopted tokenizer and MASK), generate
from the import, to-hf --format hf of an AR import (plain transformers loads it), and the refusals."""
import dataclasses
import json

import pytest
import torch

from ..model.test_hf_families import V, _tokenizer
from .conftest import run_here


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    import transformers

    config = transformers.Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      tie_word_embeddings=True, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3")
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(path))
    _tokenizer(path, "qwen")
    return path


def test_from_hf_under_an_objective_then_generate(qwen3_dir, tmp_path):
    from setdiff_mega.checkpoint import load_model

    r = run_here(["tools/convert_checkpoint.py", "from-hf", qwen3_dir, tmp_path / "run", "--objective", "setdlm",
                  "--D", "2", "data.seq_length=16"])
    assert r.returncode == 0, r.stderr
    assert "train.init_from=" in r.stdout
    model, _, tok, cfg = load_model(tmp_path / "run")
    assert (cfg.objective.name, cfg.objective.D, cfg.data.seq_length) == ("setdlm", 2, 16)
    assert (cfg.model.family, cfg.model.qk_layernorm, cfg.model.kv_channels, cfg.model.tie_embeddings) == \
        ("qwen3", True, 32, True)
    assert tok.token(tok.mask) == "<|fim_middle|>" and tok.chat_template
    r = run_here(["tools/generate.py", "--checkpoint", tmp_path / "run", "--prompt", "the cat",
                  "--max-new-tokens", "4"])
    assert r.returncode == 0, r.stderr
    r = run_here(["tools/convert_checkpoint.py", "to-hf", tmp_path / "run", tmp_path / "hf", "--format", "hf"])
    assert r.returncode == 2 and "trained with objective setdlm" in r.stderr and "without --format hf" in r.stderr


def test_to_hf_format_hf_of_an_ar_import_loads_in_plain_transformers(qwen3_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = run_here(["tools/convert_checkpoint.py", "from-hf", qwen3_dir, tmp_path / "run", "--objective", "ar"])
    assert r.returncode == 0, r.stderr
    r = run_here(["tools/convert_checkpoint.py", "to-hf", tmp_path / "run", tmp_path / "hf", "--format", "hf"])
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "auto_map" not in config
    a = AutoModelForCausalLM.from_pretrained(str(qwen3_dir)).eval()
    b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.arange(3, 12)[None]
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.eos_token == "<|endoftext|>" and tok.chat_template
    # never over something that is not a previous --format hf output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    r = run_here(["tools/convert_checkpoint.py", "to-hf", tmp_path / "run", tmp_path / "other", "--format", "hf",
                  "--overwrite"])
    assert r.returncode == 2 and (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_unknown_architecture_is_one_line(qwen3_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(qwen3_dir, d)
    config = json.loads((d / "config.json").read_text())
    config["model_type"], config["architectures"] = "gpt_neox", ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    r = run_here(["tools/convert_checkpoint.py", "from-hf", d, tmp_path / "run"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "model_type 'gpt_neox'" in r.stderr and "qwen3 (Qwen3ForCausalLM)" in r.stderr


def test_training_starts_from_an_imported_model_with_its_architecture(qwen3_dir, tmp_path):
    """Data tokenized with the import's tokenizer; ``train.init_from`` = the import, no model.* overrides: the
    run adopts the architecture (Qwen3's q / k norms, head size, tied embeddings) and starts from the
    pretrained weights (its first validation loss is the imported model's)."""
    from setdiff_mega.config import load_config
    from setdiff_mega.training import train

    from .conftest import ROOT, TINY

    r = run_here(["tools/convert_checkpoint.py", "from-hf", qwen3_dir, tmp_path / "init", "--objective", "setdlm",
                  "--D", "2"])
    assert r.returncode == 0, r.stderr
    tok = tmp_path / "init" / "checkpoints" / "step_0000000" / "tokenizer.json"
    from ..model.test_hf_families import TEXT

    (tmp_path / "raw.jsonl").write_text("".join(json.dumps({"text": f"{t} {i}"}) + "\n" for i, t in enumerate(TEXT)))
    r = run_here(["tools/preprocess_data.py", "--input", tmp_path / "raw.jsonl", "--tokenizer", tok,
                  "--output-prefix", tmp_path / "data" / "c", "--no-progress"])
    assert r.returncode == 0, r.stderr
    arch = [o for o in TINY if not o.startswith("model.")] + ["data.split=80,20,0"]
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*arch, "data.seq_length=16", "objective.D=2",
                                                        "train.train_steps=2", f"data.path={tmp_path / 'data' / 'c'}",
                                                        f"train.save_dir={tmp_path / 'run'}",
                                                        f"train.init_from={tmp_path / 'init'}",
                                                        f"data.tokenizer={tok}"])
    lines = []
    res = train(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert any("model architecture from train.init_from" in s and "qk_layernorm=True" in s for s in lines)
    assert res.final_step == 2
    from setdiff_mega.checkpoint import load_model

    model, _, _, saved = load_model(tmp_path / "run")
    assert (saved.model.family, saved.model.kv_channels, saved.model.tie_embeddings) == ("qwen3", 32, True)

    # train.init_from=hf:DIR: the same run without the separate conversion (the import runs once, in a child
    # process, into the run directory; a second start reuses it)
    direct = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=f"hf:{qwen3_dir}",
                                                                save_dir=str(tmp_path / "direct")))
    lines = []
    again = train(direct, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert [r["train/loss"] for r in again.history if "train/loss" in r] == \
        [r["train/loss"] for r in res.history if "train/loss" in r]
    assert sum("importing" in s for s in lines) == 1
    lines = []
    resumed = dataclasses.replace(direct, train=dataclasses.replace(direct.train, train_steps=3))
    train(resumed, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert not any("importing" in s for s in lines) and len(list((tmp_path / "direct" / "init_from_hf").iterdir())) == 1


def test_init_from_hf_errors_are_one_line(qwen3_dir, tmp_path, monkeypatch):
    """A directory without config.json, a failing import (a model of no supported family), and another rank
    that sees rank 0's failure note: one line each, naming the directory."""
    import shutil

    from setdiff_mega.checkpoint import CheckpointError
    from setdiff_mega.checkpoint.hf_init import content_key, resolve_init
    from setdiff_mega.config import load_config

    def cfg(src):
        return load_config(None, [f"train.init_from=hf:{src}", f"train.save_dir={tmp_path / 'run'}"])

    with pytest.raises(CheckpointError, match=r"config.json' does not exist; name a local Hugging Face model"):
        resolve_init(cfg(tmp_path / "nothing"))
    bad = tmp_path / "gpt2"
    shutil.copytree(qwen3_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match=r"hf:.*gpt2: the import failed: .*'gpt2' .*is not a supported"):
        resolve_init(cfg(bad), log=lambda *a: None)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CheckpointError, match=r"the import failed: .*is not a supported"):
        resolve_init(cfg(bad))                                      # rank 1 reads rank 0's note of this start
    assert len(list((tmp_path / "run" / "init_from_hf").glob(f"{content_key(bad, 'setdlm')}.failed-*"))) == 1
    with pytest.raises(CheckpointError, match=r"rank 0 did not finish importing into .* within 0 s"):
        resolve_init(cfg(qwen3_dir), timeout=0)
