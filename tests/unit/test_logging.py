"""Training metrics reach TensorBoard (``logging.tensorboard=true``: event files in ``save_dir/tensorboard``
with the same scalars as metrics.jsonl) and carry the peak memory of rank 0 and of the largest rank."""
import json

import pytest


def test_tensorboard_events_and_peak_memory(tmp_path, mcore):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from setdiff_mega.config import load_config
    from setdiff_mega.data.prepare import prepare
    from setdiff_mega.training import train

    data = tmp_path / "data"
    prepare(data, None, num_math=60, num_stories=60, vocab_size=300, heldout=4, log=lambda *a: None)
    save = tmp_path / "run"
    cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
                             "data.seq_length=32", f"data.path={data}/corpus", "train.train_steps=4",
                             "train.micro_batch_size=2", "train.eval_iters=1", "train.eval_interval=2",
                             "train.log_interval=2", f"train.save_dir={save}", "logging.wandb=disabled",
                             "logging.progress=false", "logging.tensorboard=true"])
    train(cfg, log=lambda *a: None)
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in logged] == [2, 4]
    assert all(0.05 < r["mem/peak_rss_gib"] <= r["mem/peak_rss_gib_max_rank"] < 64 for r in logged)
    acc = EventAccumulator(str(save / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "val/loss", "mem/peak_rss_gib", "train/grad_norm"} <= set(acc.Tags()["scalars"])
    tb = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert tb == {r["step"]: pytest.approx(r["train/loss"], rel=1e-6) for r in logged}
