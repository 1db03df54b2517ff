"""The trainer's checkpoint seams without a model (issue 15): which checkpoint a run resumes
(``find_resume``) and whether it may (``check_resumable``), on fabricated checkpoint directories."""
import pytest

from setdiff_mega.checkpoint.io import CheckpointError, prepare_staging, publish
from setdiff_mega.checkpoint.manager import check_resumable
from setdiff_mega.checkpoint.rundir import find_resume
from setdiff_mega.config import dump_yaml, load_config


def _cfg(save_dir, *over):
    return load_config(None, [f"train.save_dir={save_dir}", "objective.name=setdlm", "objective.D=4", *over])


def _fake(save_dir, step: int, cfg, kind: str = "training"):
    tmp = prepare_staging(save_dir, step)
    dump_yaml(cfg, tmp / "config.yaml")
    return publish(tmp, {"step": step, "kind": kind}, keep_last=5)


def test_find_resume_none_auto_and_explicit(tmp_path):
    cfg = _cfg(tmp_path)
    assert find_resume(cfg) is None                                   # auto, nothing saved yet
    for step in (2, 5, 3):
        _fake(tmp_path, step, cfg)
    ck, state = find_resume(cfg)
    assert ck.name == "step_0000005" and state["step"] == 5           # the newest complete step
    assert find_resume(_cfg(tmp_path, "train.resume=none")) is None
    ck, state = find_resume(_cfg(tmp_path, f"train.resume={tmp_path / 'checkpoints' / 'step_0000002'}"))
    assert state["step"] == 2


@pytest.mark.parametrize("change,field", [("objective.D=2", "objective.D"), ("data.seq_length=64", "data.seq_length"),
                                          ("objective.name=bd3lm", "objective.name")])
def test_a_run_with_other_identity_fields_is_refused(tmp_path, change, field):
    found = (_fake(tmp_path, 4, _cfg(tmp_path)), {"kind": "training"})
    with pytest.raises(CheckpointError, match=rf"trained with {field}=.*to continue it keep"):
        check_resumable(found, _cfg(tmp_path, change))
    check_resumable(found, _cfg(tmp_path))                            # the same run resumes


def test_weights_only_checkpoint_is_not_resumed(tmp_path):
    cfg = _cfg(tmp_path)
    ck = _fake(tmp_path, 4, cfg, kind="weights")
    with pytest.raises(CheckpointError, match="weights-only checkpoint .* train.init_from="):
        check_resumable((ck, {"kind": "weights"}), cfg)


def test_other_architecture_is_refused(tmp_path):
    found = (_fake(tmp_path, 4, _cfg(tmp_path)), {"kind": "training"})
    with pytest.raises(CheckpointError, match="hidden_size"):
        check_resumable(found, _cfg(tmp_path, "model.hidden_size=96"))
