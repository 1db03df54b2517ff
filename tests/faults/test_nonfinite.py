"""train.nonfinite: a NaN on one rank skips the step on every rank (or stops the run), under DP = 2 and
TP = 2, exactly like one process that skips the same step (issue 16, policies)."""
import json
import math

import pytest
import torch

from ..distributed.harness import run_ranks
from ..distributed.test_parallel_training import _config, _make_init, _weights

BAD_STEP = 1          # 0-based: the second of four steps


def _poisoned(rank, world, data_dir, save_dir, tp, init, mbs, bad_rank, extra=()):
    from setdiff_mega.training import TrainingError, optim, train
    from setdiff_mega.training import trainer as T

    step = {"now": -1}
    real_lr, real_obj = optim.lr_at, T.objective_from_config

    def lr_at(s, tc):                          # the trainer asks once per step, before the forward
        step["now"] += 1
        return real_lr(s, tc)

    def objective(cfg, tok):
        obj = real_obj(cfg, tok)
        base = obj.loss

        def loss(logits, inputs):
            value, stats = base(logits, inputs)
            if torch.is_grad_enabled() and rank == bad_rank and step["now"] == BAD_STEP:
                value = value * float("nan")
            return value, stats
        obj.loss = loss
        return obj
    optim.lr_at, T.objective_from_config = lr_at, objective
    try:
        cfg = _config(data_dir, save_dir, tp, 1, "setdlm", init, mbs, extra=["train.nonfinite=skip", *extra])
        try:
            res = train(cfg, log=lambda *a: None)
        except TrainingError as e:
            return {"error": str(e)}
    finally:
        optim.lr_at, T.objective_from_config = real_lr, real_obj
    rows = [r for r in res.history if "train/loss" in r]
    return {"loss": [r["train/loss"] for r in rows], "lr": [r["train/lr"] for r in rows],
            "skipped": [r["train/skipped_steps"] for r in rows], "val": res.final_val_loss}


def _state(save_dir):
    ck = sorted((save_dir / "checkpoints").glob("step_*"))[-1]
    return json.loads((ck / "state.json").read_text())


@pytest.mark.parametrize("tp, world, mbs, bad_rank", [(1, 2, 2, 1), (2, 2, 4, 1)])
def test_a_nan_on_one_rank_skips_the_step_everywhere_like_one_process(tiny_data, tmp_path, tp, world, mbs, bad_rank):
    run_ranks(_make_init, world=1, args=(tiny_data, tmp_path / "init"))
    init = tmp_path / "init"
    cosine = ("train.lr_schedule=cosine", "train.min_lr=0")
    ref = run_ranks(_poisoned, world=1, args=(tiny_data, tmp_path / "ref", 1, init, 4, 0, cosine))[0]
    assert ref["skipped"] == [0, 1, 1, 1] and math.isnan(ref["loss"][BAD_STEP])
    # the schedule does not advance over the skipped step: steps 2 and 3 use the rates of steps 1 and 2
    assert ref["lr"][BAD_STEP + 1] == ref["lr"][BAD_STEP] != ref["lr"][BAD_STEP + 2]
    assert _state(tmp_path / "ref")["skipped_steps"] == 1
    out = run_ranks(_poisoned, world=world, args=(tiny_data, tmp_path / "par", tp, init, mbs, bad_rank, cosine))
    for r in out.values():
        good = [x for i, x in enumerate(r["loss"]) if i != BAD_STEP]
        assert good == pytest.approx([x for i, x in enumerate(ref["loss"]) if i != BAD_STEP], rel=1e-4)
        assert r["skipped"] == ref["skipped"] and r["val"] == pytest.approx(ref["val"], rel=1e-4)
    a = run_ranks(_weights, world=1, args=(tmp_path / "ref",))[0]
    b = run_ranks(_weights, world=1, args=(tmp_path / "par",))[0]
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, rtol=1e-3, atol=1e-4, msg=k)


def test_too_many_skips_in_a_row_stop_the_run_naming_the_field(tiny_data, tmp_path):
    run_ranks(_make_init, world=1, args=(tiny_data, tmp_path / "init"))
    out = run_ranks(_poisoned, world=2, args=(tiny_data, tmp_path / "run", 1, tmp_path / "init", 2, 0,
                                              ("train.max_skipped_steps=0",)))
    for r in out.values():
        assert "1 bad steps in a row exceed train.max_skipped_steps=0" in r["error"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_guard_policies_and_spike_warning():
    from types import SimpleNamespace

    from setdiff_mega.training.guard import StepGuard, TrainingError

    msgs = []
    tc = SimpleNamespace(nonfinite="skip", max_skipped_steps=2, spike_factor=2.0, lr=1e-3)
    g = StepGuard(tc, skipped=3, log=msgs.append)            # resumed with 3 skipped steps
    assert g.schedule_step(10) == 7
    ok = torch.tensor(1.0)
    for i in range(25):
        assert g.accept(i, 1.0, ok)
    assert g.accept(25, 5.0, ok) and g.spikes == 1 and "loss spike at step 26" in msgs[-1]
    assert not g.accept(26, float("nan"), ok) and not g.accept(27, 1.0, torch.tensor(float("inf")))
    with pytest.raises(TrainingError, match="3 bad steps in a row exceed train.max_skipped_steps=2"):
        g.accept(28, float("inf"), ok)
    assert g.metrics() == {"train/skipped_steps": 6, "train/loss_spikes": 1}
    with pytest.raises(TrainingError, match=r"at step 1; no update was applied.*train.nonfinite=skip"):
        StepGuard(SimpleNamespace(nonfinite="stop", lr=1e-3, spike_factor=0)).accept(0, float("nan"), ok)
