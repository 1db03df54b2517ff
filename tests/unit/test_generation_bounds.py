"""The generation options' one table of bounds (decoding/base.py BOUNDS): every field refused outside its bound,
of the wrong type or non-finite, with one line naming it; token choice finite at any temperature; a step that
cannot commit fails instead of looping."""
import math

import pytest
import torch

from setdiff_mega.decoding.base import BOUNDS, Canvas, DecodeState, GenerationConfig, NoProgress
from setdiff_mega.decoding.sampling import choose_tokens


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_field_is_refused_outside_its_bound(name):
    kind, lo, hi = BOUNDS[name]
    kind = kind[0] if isinstance(kind, tuple) else kind
    GenerationConfig(**{name: lo}).validate() if name != "stop_repeat" else None
    GenerationConfig(**{name: hi}).validate()
    below = lo - 1 if kind is int else (-1.0 if lo == 0 else lo / 2)
    above = hi + 1 if kind is int else (math.inf if hi >= 1e308 else hi * 2)
    for bad in (below, above, "x", True, [1]) + ((math.nan, math.inf) if kind is float else (1.5,)):
        with pytest.raises(ValueError, match=name) as e:
            GenerationConfig(**{name: bad}).validate()
        assert "\n" not in str(e.value)


def test_length_penalty_and_choices():
    GenerationConfig(length_penalty=(10, 1.1)).validate()
    for bad in ((10, 1e9), (-1, 1.1), (10,), "80,1.1"):
        with pytest.raises(ValueError, match="length_penalty"):
            GenerationConfig(length_penalty=bad).validate()
    with pytest.raises(ValueError, match="stop_repeat"):
        GenerationConfig(stop_repeat=1).validate()
    with pytest.raises(ValueError, match="commit_rule"):
        GenerationConfig(commit_rule="x").validate()


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-3, 1.0, 1e4])
def test_token_choice_is_finite_at_any_temperature_and_with_nonfinite_logits(temperature):
    logits = torch.randn(2, 3, 11) * 30
    logits[0, 0, 2], logits[0, 1, 5], logits[1, 2, 7] = math.nan, math.inf, -math.inf
    tok, conf = choose_tokens(logits, [10], temperature, 1e-300, torch.Generator().manual_seed(0))
    assert torch.isfinite(conf).all() and (tok != 10).all() and (tok[0, 0] != 2)
    greedy, _ = choose_tokens(logits, [10], 0.0)
    if temperature <= 1e-3:                                # a tiny temperature is greedy in effect
        assert torch.equal(tok[1], greedy[1])


def test_a_step_that_commits_nothing_for_a_busy_row_fails():
    canvas = Canvas.from_prompts([[1, 2], [1]], 9, 8, 3)
    st = DecodeState(canvas, GenerationConfig(max_new_tokens=3), eos_id=7, mask_id=9)
    q = torch.tensor([[2], [1]])
    st.commit(q, torch.tensor([[True], [True]]), torch.tensor([[4], [5]]), st.live(), expect=torch.tensor([True, True]))
    with pytest.raises(NoProgress, match="no progress in row 1"):
        st.commit(q + 1, torch.tensor([[True], [False]]), torch.tensor([[4], [5]]), st.live(),
                  expect=torch.tensor([True, True]))
