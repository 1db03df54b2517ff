"""End to end: tools/prepare_data.py -> pretrain/pretrain.py -> checkpoint -> reload, on tiny data."""
import json

import pytest
import torch

from .conftest import ROOT, TINY, _run, run_here


def test_pretrain_cli_end_to_end_and_reload(trained_run, mcore):
    save, r = trained_run
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 12 and summary["final_val_loss"] < summary["initial_val_loss"]
    ck = save / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_0000012"
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["step_0000010", "step_0000012"]
    assert not list(ck.glob("*.tmp*"))
    for f in ("dist/.metadata", "rng/rank_00000.pt", "config.yaml", "tokenizer.json", "state.json"):
        assert (ck / "step_0000012" / f).is_file()
    state = json.loads((ck / "step_0000012" / "state.json").read_text())
    assert state["kind"] == "training" and state["optimizer"] == "adamw" and state["consumed_samples"] == 12 * 4
    assert (save / "loss_curve.png").stat().st_size > 1000
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert any("perf/processed_tokens_per_s" in x for x in rows)
    tps = [x for x in rows if "perf/sample_tokens_per_s" in x][-1]
    assert tps["perf/processed_tokens_per_s"] == pytest.approx(2 * tps["perf/sample_tokens_per_s"], rel=1e-6)

    # the checkpoint alone rebuilds the model, objective and tokenizer and reproduces the validation loss
    from setdiff_mega.checkpoint import load_model
    from setdiff_mega.data.loader import build_splits, wrap_ids
    from setdiff_mega.training import evaluate

    model, objective, tok, cfg = load_model(save)
    assert objective.name == "setdlm" and tok.mask == objective.mask_id
    n = cfg.train.eval_iters * cfg.train.micro_batch_size
    _, valid, _ = build_splits(cfg.data.path, tok, cfg.data.seq_length, cfg.data.split, cfg.data.seed,
                               (12 * 4, n, n), cfg.data.cache_dir)
    val = evaluate(model, objective, valid, cfg, cfg.train.eval_iters, bos_eos=wrap_ids(cfg.data, tok))
    assert val["loss"] == pytest.approx(summary["final_val_loss"], abs=1e-4)


@pytest.mark.parametrize("objective", ["ar", "mdlm", "bd3lm"])
def test_baselines_train_in_process(data_dir, tmp_path, mcore, objective):
    from setdiff_mega.config import load_config
    from setdiff_mega.training import train

    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*TINY, "train.train_steps=8", f"objective.name={objective}",
                                                        f"data.path={data_dir / 'corpus'}",
                                                        f"train.save_dir={tmp_path}", "train.lr=3e-3",
                                                        "train.peak_tflops=1.0"])
    res = train(cfg, log=lambda *a: None)
    assert res.final_val_loss < res.initial_val_loss
    perf = [r for r in res.history if "perf/mfu" in r][-1]          # MFU against the configured peak
    assert perf["perf/mfu"] == pytest.approx(perf["perf/model_tflops_per_device"] / 1.0) and perf["perf/mfu"] > 0
    ratio = res.processed_tokens_per_s / res.sample_tokens_per_s
    assert ratio == pytest.approx({"ar": 31 / 32, "mdlm": 1.0, "bd3lm": 2.0}[objective], rel=1e-6)


@pytest.mark.parametrize("overrides,message", [
    (["objective.name=gpt"], "error: objective.name='gpt' is not one of ar, mdlm, bd3lm, setdlm"),
    (["objective.D=16", "objective.S_max=8"], "error: objective.D=16 exceeds objective.S_max=8"),
    (["objective.S_max=999"], "error: objective.S_max=999 exceeds data.seq_length L=128"),
    (["data.path=/nonexistent/corpus"], "error: data file '/nonexistent/corpus.bin' does not exist; set data.path"),
])
def test_cli_config_errors_are_one_clear_line(overrides, message):
    r = _run(["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *overrides])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(message), r.stderr
    assert "Traceback" not in r.stderr


def test_cli_vocab_smaller_than_data(data_dir):
    r = _run(["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", f"data.path={data_dir / 'corpus'}",
              "model.vocab_size=100"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "but the model vocabulary has only 100 entries" in r.stderr
    assert "raise model.vocab_size to at least" in r.stderr


def test_non_finite_loss_stops_with_a_clear_error(data_dir, tmp_path, mcore, monkeypatch):
    import torch

    from setdiff_mega.config import load_config
    from setdiff_mega.training import TrainingError, train
    from setdiff_mega.training import trainer as trainer_mod

    real = trainer_mod.objective_from_config

    def poisoned(cfg, tok):
        obj = real(cfg, tok)
        base = obj.loss

        def loss(logits, inputs):
            value, stats = base(logits, inputs)
            return value * torch.tensor(float("nan")), stats
        obj.loss = loss
        return obj

    monkeypatch.setattr(trainer_mod, "objective_from_config", poisoned)
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*TINY, "train.train_steps=3", f"data.path={data_dir / 'corpus'}",
                                                        f"train.save_dir={tmp_path}"])
    with pytest.raises(TrainingError, match=r"non-finite loss \(nan\).* at step 1; no update was applied"):
        train(cfg, log=lambda *a: None)
    assert not (tmp_path / "checkpoints").exists()


def test_dataset_written_by_megatron_builder_trains(data_dir, tmp_path, mcore):
    """Interop: a .bin/.idx written directly with megatron-core's builder (no manifest) trains as is."""
    import shutil

    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from setdiff_mega.config import load_config
    from setdiff_mega.data import Tokenizer
    from setdiff_mega.training import train

    tok = Tokenizer.from_file(data_dir / "tokenizer.json")
    shutil.copy(data_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    builder = IndexedDatasetBuilder(str(tmp_path / "mega.bin"), dtype=np.int32)   # int32, unlike ours
    for line in (data_dir / "tasks" / "math.jsonl").read_text().splitlines() * 20:
        text = json.loads(line)["text"]
        builder.add_item(torch.tensor([tok.bos] + tok.encode(text) + [tok.eos]))
        builder.end_document()
    builder.finalize(str(tmp_path / "mega.idx"))
    assert not (tmp_path / "mega.manifest.json").exists()
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*TINY, "train.train_steps=6", f"data.path={tmp_path / 'mega'}",
                                                        f"train.save_dir={tmp_path / 'run'}", "train.lr=3e-3"])
    res = train(cfg, log=lambda *a: None)
    assert res.final_val_loss < res.initial_val_loss


def test_rerun_continues_and_a_changed_run_is_refused(trained_run, data_dir):
    """train.resume=auto: the same command on a finished run has nothing to train; another objective or
    model size in the same save_dir stops with the difference and the fix."""
    save, _ = trained_run
    base = ["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY, "train.train_steps=12",
            f"data.path={data_dir / 'corpus'}", f"train.save_dir={save}", "train.save_interval=5"]
    r = _run(base)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "is already at train.train_steps=12: nothing to train" in r.stdout + r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["final_step"] == 12
    r = _run(base + ["objective.name=ar"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "was trained with objective.name='setdlm', this run has 'ar'" in r.stderr and "train.init_from=" in r.stderr
    r = _run(base + ["model.hidden_size=64"])
    assert r.returncode == 2 and "was trained with model.hidden_size=32, this run has model.hidden_size=64" in r.stderr


def test_bf16_fp8_setcausal_training_and_interchangeable_checkpoint(data_dir, tmp_path, mcore):
    """The GPU-path options train end to end on CPU (bf16 autocast, torchao FP8 emulated, mask-free set-causal
    attention), and the checkpoint loads into a plain model: FP8 and the backend change nothing stored."""
    pytest.importorskip("torchao")
    from setdiff_mega.checkpoint import load_weights
    from setdiff_mega.config import load_config
    from setdiff_mega.data import Tokenizer
    from setdiff_mega.model import build_model
    from setdiff_mega.model.fp8 import float8_layers
    from setdiff_mega.training import train

    overrides = [*TINY, "train.train_steps=8", f"data.path={data_dir / 'corpus'}", f"train.save_dir={tmp_path}",
                 "train.lr=3e-3", "train.precision=bf16", "model.fp8=torchao", "model.attention_backend=setcausal"]
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", overrides)
    res = train(cfg, log=lambda *a: None)
    assert res.final_val_loss < res.initial_val_loss
    vocab = Tokenizer.from_file(data_dir / "tokenizer.json").vocab_size
    plain_cfg = load_config(ROOT / "configs/tiny_cpu.yaml", TINY).model
    plain = build_model(plain_cfg, vocab)
    assert not float8_layers(plain)
    before = {k: v.clone() for k, v in plain.state_dict().items() if isinstance(v, torch.Tensor)}
    load_weights(plain, res.checkpoint, plain_cfg)
    changed = [k for k, v in plain.state_dict().items() if k in before and not torch.equal(v, before[k])]
    assert len(changed) > 0.5 * len(before)


def test_ema_weights_are_trained_saved_and_selectable(data_dir, tmp_path):
    """train.ema_decay: the run reports the EMA's validation loss, the checkpoint holds it next to the weights,
    generation / evaluation / export take it by default and --weights raw picks the raw weights."""
    save = tmp_path / "ema"
    r = _run(["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY, "train.train_steps=6",
              "train.ema_decay=0.8", f"data.path={data_dir / 'corpus'}", f"train.save_dir={save}"])
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["final_val_loss_ema"] != summary["final_val_loss"]
    ins = run_here(["tools/inspect_checkpoint.py", str(save)])
    assert "EMA tensors" in ins.stdout, ins.stdout
    ev = {}
    for weights in ("ema", "raw"):
        out = tmp_path / f"eval_{weights}.json"
        e = run_here(["tools/evaluate.py", "--checkpoint", str(save), "--no-tasks", "--max-sequences", "8",
                  "--weights", weights, "--out", str(out)])
        assert e.returncode == 0, e.stderr[-2000:]
        ev[weights] = json.loads(out.read_text())
    assert ev["ema"]["weights"] == "ema" and ev["raw"]["weights"] == "raw"
    assert ev["ema"]["likelihood"]["nll_per_token"] != ev["raw"]["likelihood"]["nll_per_token"]
    g = run_here(["tools/generate.py", "--checkpoint", str(save), "--prompt", "Question:", "--max-new-tokens", "4"])
    assert g.returncode == 0, g.stderr[-2000:]
    hf = tmp_path / "hf"
    c = run_here(["tools/convert_checkpoint.py", "to-hf", str(save), str(hf)])
    assert c.returncode == 0 and "(ema weights)" in c.stdout, c.stderr[-2000:]
    bad = run_here(["tools/generate.py", "--checkpoint", str(hf), "--prompt", "x", "--weights", "raw"])
    assert bad.returncode == 2 and "export of the ema weights" in bad.stderr and "Traceback" not in bad.stderr
    none = run_here(["tools/evaluate.py", "--checkpoint", str(hf), "--no-tasks", "--max-sequences", "4"])
    assert none.returncode == 0, none.stderr[-2000:]


def test_asking_for_ema_of_a_run_without_it_is_one_clear_line(trained_run):
    save, _ = trained_run
    r = run_here(["tools/generate.py", "--checkpoint", str(save), "--prompt", "x", "--weights", "ema"])
    assert r.returncode == 2 and "holds no EMA weights" in r.stderr and "Traceback" not in r.stderr, r.stderr
