"""The gate's statistical test: is a candidate policy not worse than the live one?

A one-sided Welch t non-inferiority test on the two samples of gate rewards (one reward per gate
try, failed tries 0; binary or continuous). With ``d = mean(candidate) - mean(live)``,
``se = sqrt(s_c^2/n_c + s_l^2/n_l)`` (``s^2``: sample variances, ``n - 1`` in the denominator) and the
Welch-Satterthwaite degrees of freedom ``df``, the one-sided lower confidence bound on the true
difference is ``lower = d - t(confidence, df) * se``; the candidate is **not worse** (promoted) when
``lower >= -margin``. The rollback watch uses the same figures from above: the new version is **worse**
(rolled back) when ``upper = d + t(confidence, df) * se < -margin``. When both samples are constant
(``se == 0``), ``lower = upper = d``. Each sample needs
at least 2 rewards. The burden of proof is on the candidate: with few gate tries the bound is wide
and an equal candidate is refused (docs/continuous-safety.md has the sizes that promote one).

Pure functions, no dependency: the Student t quantile is computed here (regularized incomplete beta
by continued fraction, inverted by bisection), checked against published tables in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..errors import ConfigurationError


@dataclass(frozen=True, slots=True)
class GateTest:
    """The figures of one test (module doc) and its decision."""

    n_candidate: int
    n_live: int
    mean_candidate: float
    mean_live: float
    difference: float  # mean_candidate - mean_live
    standard_error: float
    df: float | None  # Welch-Satterthwaite; None when se == 0
    t_critical: float | None
    lower_bound: float  # of the true difference, at ``confidence``, one-sided
    upper_bound: float  # the same, from above: d + t * se
    margin: float
    confidence: float
    not_worse: bool  # lower_bound >= -margin: the gate promotes
    worse: bool  # upper_bound < -margin: the candidate lost more than the margin (the rollback watch)

    def figures(self) -> dict[str, float | int | bool | None]:
        return asdict(self)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (``df`` > 0, not necessarily whole)."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (0.5 <= p < 1)."""
    if not 0.5 <= p < 1.0 or not df > 0:
        raise ConfigurationError(f"t_quantile needs 0.5 <= p < 1 and df > 0, got p={p!r}, df={df!r}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2.0


def _mean_var(xs: Sequence[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    return mean, sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


def not_worse(candidate: Sequence[float], live: Sequence[float], *, margin: float = 0.1,
              confidence: float = 0.9) -> GateTest:
    """The module doc's test of ``candidate``'s rewards against ``live``'s."""
    if not 0.5 <= confidence < 1.0:
        raise ConfigurationError(f"confidence must be in [0.5, 1), e.g. 0.9; got {confidence!r}")
    if not margin >= 0 or math.isinf(margin):
        raise ConfigurationError(f"margin must be a finite number >= 0 (a reward difference), got {margin!r}")
    for name, xs in (("candidate", candidate), ("live", live)):
        if len(xs) < 2:
            raise ConfigurationError(f"the gate needs at least 2 rewards per policy, got {len(xs)} for the {name}; "
                                     "give more gate tasks or tries per task (gate_n)")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs):
            raise ConfigurationError(f"the {name}'s gate rewards must be finite numbers, got {list(xs)[:10]!r}")
    mc, vc = _mean_var(candidate)
    ml, vl = _mean_var(live)
    a, b = vc / len(candidate), vl / len(live)
    se = math.sqrt(a + b)
    diff = mc - ml
    if se == 0.0:
        df = t = None
        lower = upper = diff
    else:
        df = (a + b) ** 2 / (a * a / (len(candidate) - 1) + b * b / (len(live) - 1))
        t = t_quantile(confidence, df)
        lower, upper = diff - t * se, diff + t * se
    return GateTest(len(candidate), len(live), mc, ml, diff, se, df, t, lower, upper, float(margin), float(confidence),
                    lower >= -margin, upper < -margin)
