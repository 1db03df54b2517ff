"""Noise schedules: the staggered order prior of SetDLM and the linear schedule of MDLM / BD3LM.

Staggered schedule (method.md section 2). With sequence length L (= block length BL), the knob D
(``desired_block_size``) and the window S_max (``max_block_size``, default 2D):

    desired_area = D / (2 L)
    k given:        b = desired_area (k + 1) / k
    b given:        k = desired_area / (b - desired_area)
    D not in {1, S_max}:  b = S_max / (L + S_max - 1),  k = desired_area / (b - desired_area)
    otherwise:      k = 1,  b = 2 desired_area
    loc_i = (1 - b) (L - 1 - i) / (L - 1),   i = 0..L-1     (position 0 has the LARGEST loc)

Position i has its first-hitting time in the window [loc_i, loc_i + b); neighbouring windows are
Delta = (1 - b)/(L - 1) apart, so with the default b each window overlaps S_max - 1 neighbours.
Per-position schedule, all in float64, x_i(t) = (t - loc_i) / b:

    move_i(t)   = 1 - (1 - clamp(x_i, 0, 1 - eps))^k      (1 if x_i >= 1, 0 if x_i <= 0)
    alpha_i(t)  = 1 - move_i(t)
    alpha'_i(t) = -(k / b) (1 - clamp(x_i, 0, 1 - eps))^(k - 1),   0 where x_i > 1 or x_i <= 0

Tensor layouts: ``loc`` is [L] float64; ``alpha(t)`` takes t of shape [...] and returns [..., L].
The linear schedule is alpha(t) = 1 - t, alpha'(t) = -1 (MDLM / BD3LM, t ~ U[eps, 1]).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_EPS64 = torch.finfo(torch.float64).eps


def default_s_max(D: int, S_max: int | None = None) -> int:
    """SetDLM's window S_max: 2D unless set (method.md 2.2)."""
    return 2 * int(D) if S_max is None else int(S_max)


@dataclass(frozen=True)
class StaggeredSchedule:
    """Constants of the staggered first-hitting-time prior for length ``length`` and knob ``D``.

    Build it with :meth:`create`; the fields are the derived constants (b, k) and the inputs.
    """

    length: int
    D: int
    S_max: int
    b: float
    k: float
    loc: torch.Tensor = field(repr=False, compare=False)

    @staticmethod
    def create(length: int, D: int, S_max: int | None = None, k: float | None = None,
               b: float | None = None) -> "StaggeredSchedule":
        """Derive (b, k, loc) exactly as method.md section 2.2; ``S_max`` defaults to 2D."""
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        if D < 1:
            raise ValueError(f"D must be >= 1, got {D}")
        S_max = default_s_max(D, S_max)
        if D > S_max:
            raise ValueError(f"D={D} must not exceed S_max={S_max}")
        if S_max > length:
            raise ValueError(f"S_max={S_max} must not exceed the sequence length L={length}")
        area = D / (2.0 * length)
        if k is not None:
            if k <= 0:
                raise ValueError(f"k must be > 0, got {k}")
            b_val, k_val = area * (k + 1.0) / k, float(k)
        elif b is not None:
            if b <= area:
                raise ValueError(f"b={b} must exceed D/(2L)={area}")
            b_val, k_val = float(b), area / (b - area)
        elif D not in (1, S_max):
            b_val = S_max / (length + S_max - 1.0)
            k_val = area / (b_val - area)
        else:
            k_val, b_val = 1.0, 2.0 * area
        if not (b_val <= 1.0 + 1e-12):
            raise ValueError(f"derived b={b_val} > 1 (D={D}, L={length}, k={k}, b={b}): lower D or raise L")
        assert abs(k_val / (k_val + 1.0) * b_val - area) < 1e-6
        if length == 1:
            loc = torch.zeros(1, dtype=torch.float64)
        else:
            i = torch.arange(length, dtype=torch.float64)
            loc = (1.0 - b_val) * (length - 1 - i) / (length - 1)
        return StaggeredSchedule(length=length, D=D, S_max=S_max, b=b_val, k=k_val, loc=loc)

    @property
    def spacing(self) -> float:
        """Delta = (1 - b) / (L - 1), the distance between neighbouring locs."""
        return (1.0 - self.b) / max(self.length - 1, 1)

    def locs(self, n: int | None = None) -> torch.Tensor:
        """The last ``n`` locs (generation over n < L positions keeps the relative spacing). For n > L
        (decoding past the training length) the same spacing continues to the left,
        loc_j = (1 - b) (n - 1 - j) / (L - 1), so the last L values are the schedule's own locs."""
        if n is None or n <= self.length:
            return self.loc if n is None else self.loc[self.length - n:]
        i = torch.arange(n, dtype=torch.float64)
        return (1.0 - self.b) * (n - 1 - i) / max(self.length - 1, 1)

    def _x(self, t: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(t, dtype=torch.float64)
        return (t.unsqueeze(-1) - self.loc) / self.b

    def alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        """alpha_i(t) in float64, shape [..., L] for t of shape [...]."""
        x = self._x(t)
        xc = x.clamp(0.0, 1.0 - _EPS64)
        move = -torch.expm1(self.k * torch.log1p(-xc))
        move = torch.where(x >= 1.0, torch.ones_like(move), move)
        move = torch.where(x <= 0.0, torch.zeros_like(move), move)
        if self.D == 1:
            move = torch.where(move > 0, torch.ones_like(move), move)
        return 1.0 - move

    def alpha_prime(self, t: torch.Tensor | float) -> torch.Tensor:
        """d alpha_i / dt in float64 (not zeroed at x == 1 exactly, as in the reference)."""
        x = self._x(t)
        xc = x.clamp(0.0, 1.0 - _EPS64)
        d = -(self.k / self.b) * (1.0 - xc) ** (self.k - 1.0)
        return torch.where((x > 1.0) | (x <= 0.0), torch.zeros_like(d), d)

    def first_hitting_times(self, exponentials: torch.Tensor) -> torch.Tensor:
        """T_i = loc_i + b (1 - exp(-E_i / k)) for E [..., n] ~ Exp(1), using the last n locs."""
        e = exponentials.to(torch.float64)
        return self.locs(e.shape[-1]) + self.b * (-torch.expm1(-e / self.k))

    def window_size(self) -> int:
        """The positional width of one hitting-time window in slots: round(b / Delta)."""
        return self.length if self.length == 1 else int(round(self.b / self.spacing))


@dataclass(frozen=True)
class LinearSchedule:
    """MDLM's linear schedule: alpha(t) = 1 - t, so a token is MASK with probability t."""

    eps: float = 1e-3

    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        return 1.0 - torch.as_tensor(t, dtype=torch.float64)

    def alpha_prime(self, t: torch.Tensor) -> torch.Tensor:
        return -torch.ones_like(torch.as_tensor(t, dtype=torch.float64))

    def elbo_weight(self, t: torch.Tensor) -> torch.Tensor:
        """-alpha'(t) / (1 - alpha(t)) = 1 / t, the NELBO weight of a masked token."""
        return -self.alpha_prime(t) / (1.0 - self.alpha(t))

    def sample_t(self, shape, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
        """t ~ U[eps, 1] in float32."""
        u = torch.rand(shape, generator=generator, device=device)
        return self.eps + (1.0 - self.eps) * u


def mean_lag_slots(schedule: StaggeredSchedule) -> float:
    """Mean distance below the window top in slots: k/(k+1) b / Delta (about D/2 when S_max = 2D)."""
    if schedule.length == 1:
        return 0.0
    return schedule.k / (schedule.k + 1.0) * schedule.b / schedule.spacing


__all__ = ["StaggeredSchedule", "LinearSchedule", "mean_lag_slots"]
