"""Context parallelism on gloo: CP = 2 (each rank holds two balanced chunks of every stream, keys and
values all-gathered) reproduces single-process training (losses, gradient norms, validation loss,
weights) for SetDLM, BD3LM and AR, also with TP = 2 and with PP = 2; impossible layouts stop with a
clear message."""
import pytest

from setdiff_mega.config import ConfigError

from .harness import run_ranks
from .test_parallel_training import _assert_matches, _config, _make_init, _run, tiny_data  # noqa: F401


def _cp(n):
    return (f"parallel.context_parallel_size={n}",)


@pytest.mark.parametrize("objective", ["setdlm", "bd3lm", "ar"])
def test_context_parallel_training_matches_single_process(tiny_data, tmp_path, objective):  # noqa: F811
    run_ranks(_make_init, world=1, args=(tiny_data, tmp_path / "init"))
    init = tmp_path / "init"
    ref = _run(tiny_data, tmp_path / "ref", 1, 1, 1, objective, init)[0]
    out = _run(tiny_data, tmp_path / "cp", 2, 1, 1, objective, init, 4, 0, False, _cp(2))
    _assert_matches(ref, out)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_context_parallel_with_tensor_or_pipeline_parallel(tiny_data, tmp_path, tp, pp):  # noqa: F811
    """CP = 2 x TP = 2 and CP = 2 x PP = 2 on four ranks."""
    run_ranks(_make_init, world=1, args=(tiny_data, tmp_path / "init"))
    init = tmp_path / "init"
    ref = _run(tiny_data, tmp_path / "ref", 1, 1, 1, "setdlm", init)[0]
    out = _run(tiny_data, tmp_path / "cptp", 4, tp, pp, "setdlm", init, 4, 0, False, _cp(2))
    _assert_matches(ref, out)


def test_context_parallel_with_data_parallel(tiny_data, tmp_path):  # noqa: F811
    """CP = 2 x DP = 2: gradients averaged over the four ranks, the CP parts added."""
    run_ranks(_make_init, world=1, args=(tiny_data, tmp_path / "init"))
    init = tmp_path / "init"
    ref = _run(tiny_data, tmp_path / "ref", 1, 1, 1, "setdlm", init)[0]      # per-sequence loss: DP-exact
    out = _run(tiny_data, tmp_path / "cpdp", 4, 1, 1, "setdlm", init, 2, 0, False, _cp(2))
    _assert_matches(ref, out)


@pytest.mark.parametrize("extra,message", [
    (("data.seq_length=30",), "must be a multiple of 4"),
    (("model.attention_backend=setcausal",), "needs the dense-mask core attention"),
    (("train.zero_stage=2",), "not supported together with context parallelism"),
])
def test_impossible_context_parallel_layouts_are_refused(tmp_path, extra, message):
    from setdiff_mega.config import validate_layout

    with pytest.raises(ConfigError, match=message):           # load_config checks the layout
        _config(tmp_path, tmp_path / "run", 1, 1, "setdlm", extra=(*_cp(2), *extra))
    with pytest.raises(ConfigError, match="TP\\*CP\\*PP = 1\\*2\\*1 = 2"):
        validate_layout(_config(tmp_path, tmp_path / "run", 1, 1, "setdlm", extra=_cp(2)), world_size=3)
