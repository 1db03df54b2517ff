"""Staggered schedule constants (method.md 2.2 / 2.5) and alpha tables."""
import math

import pytest
import torch

from setdiff_mega.diffusion import LinearSchedule, StaggeredSchedule, mean_lag_slots

# (L, D, S_max, b, k, b/Delta, mean lag in slots) from method.md section 2.5
TABLE = [
    (1024, 4, 8, 0.007759456838, 0.3363784666, 8, 2.01),
    (1024, 8, 16, 0.01539942252, 0.3398756951, 16, 4.06),
    (1024, 16, 32, 0.03033175355, 0.3469253535, 32, 8.24),
    (128, 4, 8, 0.05925925926, 0.3580901857, 8, 2.11),
    (128, 8, 16, 0.1118881119, 0.3875338753, 16, 4.47),
    (128, 16, 32, 0.2012578616, 0.4504249292, 32, 9.94),
    (768, 4, 8, 0.01032258065, 0.3373966043, 8, None),
    (768, 8, 16, 0.02043422733, 0.3420707733, 16, None),
    (768, 16, 32, 0.04005006258, 0.3515178179, 32, None),
    (1024, 4, 1024, 0.5002442599, 0.003919646294, 1024, 4.00),
    (1024, 16, 48, 0.04481792717, 0.2111176818, 48, 8.37),
]


@pytest.mark.parametrize("L,D,S,b,k,ratio,lag", TABLE)
def test_constants_match_reference_table(L, D, S, b, k, ratio, lag):
    s = StaggeredSchedule.create(L, D, S)
    assert s.b == pytest.approx(b, rel=1e-9)
    assert s.k == pytest.approx(k, rel=1e-9)
    assert s.b / s.spacing == pytest.approx(ratio, rel=1e-9)
    assert s.window_size() == ratio
    if lag is not None:
        assert mean_lag_slots(s) == pytest.approx(lag, abs=0.006)
    assert s.k / (s.k + 1) * s.b == pytest.approx(D / (2 * L), abs=1e-12)


def test_loc_decreases_from_one_minus_b_to_zero():
    s = StaggeredSchedule.create(64, 4)
    assert s.loc.dtype == torch.float64
    assert s.loc[0].item() == pytest.approx(1 - s.b)
    assert s.loc[-1].item() == 0.0
    assert torch.all(s.loc[1:] < s.loc[:-1])
    assert torch.equal(s.locs(10), s.loc[-10:])


def test_default_s_max_is_2d_and_special_cases():
    assert StaggeredSchedule.create(128, 4).S_max == 8
    s1 = StaggeredSchedule.create(128, 1)          # D = 1: k = 1, b = 2 * D / (2L) = 1/L
    assert (s1.k, s1.b) == (1.0, pytest.approx(1 / 128))
    s_eq = StaggeredSchedule.create(128, 8, 8)     # D = S_max also switches to k = 1
    assert s_eq.k == 1.0 and s_eq.b == pytest.approx(8 / 128)


def test_k_and_b_overrides():
    s = StaggeredSchedule.create(1024, 16, 64, k=0.3)
    area = 16 / 2048
    assert s.k == 0.3 and s.b == pytest.approx(area * 1.3 / 0.3)
    s2 = StaggeredSchedule.create(1024, 16, 64, b=0.05)
    assert s2.b == 0.05 and s2.k == pytest.approx(area / (0.05 - area))


@pytest.mark.parametrize("kwargs,msg", [(dict(length=16, D=8, S_max=4), "must not exceed S_max"),
                                        (dict(length=16, D=4, S_max=32), "must not exceed the sequence length"),
                                        (dict(length=16, D=0), "D must be")])
def test_invalid_constants_raise(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        StaggeredSchedule.create(**kwargs)


def test_alpha_is_float64_monotone_and_bounded():
    s = StaggeredSchedule.create(64, 4)
    t = torch.linspace(0, 1, 201, dtype=torch.float64)
    a = s.alpha(t)                                   # [201, 64]
    assert a.dtype == torch.float64 and a.shape == (201, 64)
    assert torch.all((a >= 0) & (a <= 1))
    assert torch.all(a[1:] <= a[:-1] + 1e-15)        # alpha decreases in t
    assert torch.all(a[0] == 1.0)                    # all clean at t = 0
    assert a[-1, 0].item() < 1e-5                    # position 0 is (numerically) masked at t = 1
    # position i is fully clean below loc_i, fully masked above loc_i + b
    i = 10
    assert s.alpha(s.loc[i] - 1e-9)[i] == 1.0
    assert s.alpha(s.loc[i] + s.b + 1e-9)[i] == 0.0


def test_alpha_prime_matches_finite_difference_inside_window():
    s = StaggeredSchedule.create(64, 4)
    i = 20
    t = (s.loc[i] + 0.4 * s.b).item()
    h = 1e-7
    fd = (s.alpha(t + h)[i] - s.alpha(t - h)[i]) / (2 * h)
    assert s.alpha_prime(t)[i].item() == pytest.approx(fd.item(), rel=1e-5)
    assert s.alpha_prime(s.loc[i].item() - 1e-3)[i].item() == 0.0   # outside: zero


def test_d1_alpha_is_binary():
    s = StaggeredSchedule.create(32, 1)
    a = s.alpha(torch.linspace(0, 1, 97, dtype=torch.float64))
    assert set(a.unique().tolist()) <= {0.0, 1.0}


def test_first_hitting_times_inside_windows():
    s = StaggeredSchedule.create(256, 8)
    e = -torch.log1p(-torch.rand(4, 256, dtype=torch.float64))
    T = s.first_hitting_times(e)
    assert torch.all(T >= s.loc) and torch.all(T < s.loc + s.b)


def test_linear_schedule():
    ls = LinearSchedule(eps=1e-3)
    t = ls.sample_t((10000,), torch.Generator().manual_seed(0))
    assert t.min() >= 1e-3 and t.max() <= 1.0
    assert ls.elbo_weight(torch.tensor([0.5])).item() == pytest.approx(2.0)
    assert math.isclose(ls.alpha(torch.tensor(0.25)).item(), 0.75)
