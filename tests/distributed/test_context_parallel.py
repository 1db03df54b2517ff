"""Context parallelism on gloo: CP = 2 (each rank holds two balanced chunks of every stream, keys and
values all-gathered) reproduces single-process training (losses, gradient norms, validation loss,
weights) for SetDLM (set-causal decomposition), BD3LM and AR, and SetDLM (dense mask rows) with TP = 2,
PP = 2, DP = 2, ZeRO-2 and TP = 2 with SP; impossible layouts stop with a clear message."""
import pytest

from setdiff_mega.config import ConfigError

from .harness import run_ranks  # noqa: F401  (conftest runs modules that use the harness first)
from .test_parallel_training import _assert_matches, _config, _init, _ref, _run, tiny_data  # noqa: F401


def _cp(n):
    return (f"parallel.context_parallel_size={n}",)


@pytest.mark.parametrize("objective,backend", [("setdlm", "setcausal"), ("bd3lm", "sdpa"), ("ar", "sdpa")])
def test_context_parallel_training_matches_single_process(tiny_data, tmp_path, objective, backend):  # noqa: F811
    """SetDLM with the set-causal decomposition (each rank's chunks against the gathered keys, no mask), the
    others with the dense-mask rows; the SetDLM runs with the dense mask are the TP / PP / DP tests below."""
    init = _init(tiny_data)
    be = (f"model.attention_backend={backend}",)
    ref = _ref(tiny_data, 1, 1, objective, init, 4, 0, False, be)
    out = _run(tiny_data, tmp_path / "cp", 2, 1, 1, objective, init, 4, 0, False, (*_cp(2), *be))
    _assert_matches(ref, out)
    if backend == "setcausal":              # the CP ranks took the segment path, the reference the two-call one
        assert ref["decomposed_calls"] > 0 and all(out[r]["segment_calls"] > 0 for r in (0, 1))


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_context_parallel_with_tensor_or_pipeline_parallel(tiny_data, tmp_path, tp, pp):  # noqa: F811
    """CP = 2 x TP = 2 and CP = 2 x PP = 2 on four ranks."""
    init = _init(tiny_data)
    ref = _ref(tiny_data, 1, 1, "setdlm", init)
    out = _run(tiny_data, tmp_path / "cptp", 4, tp, pp, "setdlm", init, 4, 0, False, _cp(2))
    _assert_matches(ref, out)


@pytest.mark.parametrize("extra,world", [(("train.zero_stage=2",), 2),
                                         (("parallel.sequence_parallel=true",), 4)])
def test_context_parallel_with_zero_or_sequence_parallel(tiny_data, tmp_path, extra, world):  # noqa: F811
    """CP = 2 with DeepSpeed ZeRO-2 (partitions over the DP x CP ranks) and CP = 2 x TP = 2 with sequence
    parallelism (the TP ranks split each CP rank's positions)."""
    init = _init(tiny_data)
    ref = _ref(tiny_data, 1, 1, "setdlm", init)
    tp, sp = (2, True) if "parallel.sequence_parallel=true" in extra else (1, False)
    zero = 2 if "train.zero_stage=2" in extra else 0
    out = _run(tiny_data, tmp_path / "cpx", world, tp, 1, "setdlm", init, 4, zero, sp, _cp(2))
    _assert_matches(ref, out)


def test_context_parallel_with_data_parallel(tiny_data, tmp_path):  # noqa: F811
    """CP = 2 x DP = 2: gradients averaged over the four ranks, the CP parts added."""
    init = _init(tiny_data)
    ref = _ref(tiny_data, 1, 1, "setdlm", init)      # per-sequence loss: DP-exact
    out = _run(tiny_data, tmp_path / "cpdp", 4, 1, 1, "setdlm", init, 2, 0, False, _cp(2))
    _assert_matches(ref, out)


@pytest.mark.parametrize("extra,message", [
    (("data.seq_length=30",), "must be a multiple of 4"),
    (("model.attention_backend=local",), "needs a core attention that gathers keys"),
])
def test_impossible_context_parallel_layouts_are_refused(tmp_path, extra, message):
    from setdiff_mega.config import validate_layout

    with pytest.raises(ConfigError, match=message):           # load_config checks the layout
        _config(tmp_path, tmp_path / "run", 1, 1, "setdlm", extra=(*_cp(2), *extra))
    with pytest.raises(ConfigError, match="TP\\*CP\\*PP = 1\\*2\\*1 = 2"):
        validate_layout(_config(tmp_path, tmp_path / "run", 1, 1, "setdlm", extra=_cp(2)), world_size=3)
