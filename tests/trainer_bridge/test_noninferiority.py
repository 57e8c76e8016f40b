"""The gate's test (noninferiority.py) against published t tables and figures computed by hand."""

from __future__ import annotations

import math

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.trainer_bridge.noninferiority import not_worse, t_cdf, t_quantile


@pytest.mark.parametrize("p,df,table", [
    (0.95, 1, 6.313752), (0.975, 2, 4.302653), (0.9, 6, 1.439756), (0.9, 9, 1.383029), (0.95, 9, 1.833113),
    (0.99, 30, 2.457262), (0.5, 4, 0.0),
])
def test_t_quantiles_match_the_tables(p, df, table):
    assert t_quantile(p, df) == pytest.approx(table, abs=2e-6)
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


def test_a_worse_candidate_is_refused_with_the_figures_computed_by_hand():
    # candidate 8/10, live 10/10: d = -0.2, s_c^2 = 1.6/9, se = sqrt(0.17778/10) = 0.13333, df = 9
    test = not_worse([1, 1, 1, 0, 1, 1, 1, 1, 1, 0], [1] * 10, margin=0.1, confidence=0.9)
    assert (test.n_candidate, test.n_live, test.mean_candidate, test.mean_live) == (10, 10, 0.8, 1.0)
    assert test.standard_error == pytest.approx(0.133333, abs=1e-6) and test.df == pytest.approx(9.0)
    assert test.lower_bound == pytest.approx(-0.2 - 1.383029 * 0.133333, abs=1e-5)
    assert not test.not_worse
    # from above (the rollback watch): -0.2 + 0.1844 = -0.0156, not below -0.1: not shown worse either
    assert test.upper_bound == pytest.approx(-0.2 + 1.383029 * 0.133333, abs=1e-5) and not test.worse


def test_the_watch_sees_a_clear_drop_beyond_the_margin():
    # 2/12 against 10/12: d = -2/3; s^2 = 12 * (1/6)(5/6) / 11 each, se = sqrt(2 * s^2 / 12), df = 22
    test = not_worse([1, 1] + [0] * 10, [1] * 10 + [0, 0], margin=0.1, confidence=0.9)
    s2 = 12 * (1 / 6) * (5 / 6) / 11
    assert test.df == pytest.approx(22.0) and test.standard_error == pytest.approx(math.sqrt(2 * s2 / 12))
    assert test.upper_bound == pytest.approx(-2 / 3 + t_quantile(0.9, 22) * math.sqrt(2 * s2 / 12))
    assert test.worse and not test.not_worse


def test_continuous_rewards_use_welch_degrees_of_freedom():
    # a = var([0.2, 0.4, 0.6])/3 = 0.04/3, b = var([0.5, 0.5, 0.7, 0.7])/4 = (0.04/3)/4
    candidate, live = [0.2, 0.4, 0.6], [0.5, 0.5, 0.7, 0.7]
    a, b = 0.04 / 3, 0.04 / 3 / 4
    df = (a + b) ** 2 / (a * a / 2 + b * b / 3)
    test = not_worse(candidate, live, margin=0.3, confidence=0.95)
    assert test.df == pytest.approx(df) and test.standard_error == pytest.approx(math.sqrt(a + b))
    assert test.lower_bound == pytest.approx(-0.2 - t_quantile(0.95, df) * math.sqrt(a + b))
    assert test.not_worse == (test.lower_bound >= -0.3)


def test_equal_constant_samples_promote_and_the_margin_decides_a_small_loss():
    same = not_worse([1.0] * 4, [1.0] * 4)
    assert same.not_worse and same.lower_bound == 0.0 and same.df is None
    assert not_worse([0.95] * 4, [1.0] * 4, margin=0.1).not_worse
    assert not not_worse([0.85] * 4, [1.0] * 4, margin=0.1).not_worse


def test_small_mixed_samples_are_refused_even_when_equal():
    """The burden of proof is on the candidate: 4 tries each cannot show an equal one is not worse."""
    test = not_worse([1, 0, 1, 1], [1, 0, 1, 1], margin=0.1, confidence=0.9)
    assert test.difference == 0 and test.df == pytest.approx(6.0) and not test.not_worse
    assert test.lower_bound == pytest.approx(-1.439756 * math.sqrt(2 * 0.25 / 4), abs=1e-5)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(candidate=[1.0], live=[1.0, 0.0]), "at least 2 rewards"),
    (dict(candidate=[1.0, 0.0], live=[1.0, 0.0], confidence=1.0), "confidence"),
    (dict(candidate=[1.0, 0.0], live=[1.0, 0.0], margin=-0.1), "margin"),
    (dict(candidate=[1.0, float("nan")], live=[1.0, 0.0]), "finite"),
])
def test_bad_input_names_the_value_and_the_fix(kwargs, fragment):
    with pytest.raises(ConfigurationError, match=fragment):
        not_worse(**kwargs)
