"""Young/Daly interval against hand-computed values."""

from __future__ import annotations

import math

import pytest

from checkpointing.schedule import DEFAULT_MTBF_S, interval_steps, observed_mtbf_s, young_daly_interval_s


@pytest.mark.parametrize("cost, mtbf, expected", [(2.0, 3600.0, 120.0), (0.5, 10_800.0, math.sqrt(10_800.0)),
                                                  (0.0, 100.0, 0.0)])
def test_young_daly(cost: float, mtbf: float, expected: float) -> None:
    assert young_daly_interval_s(cost, mtbf) == pytest.approx(expected)


def test_interval_in_steps() -> None:
    assert interval_steps(2.0, 3600.0, 0.5) == 240
    assert interval_steps(2.0, 3600.0, 0.5, max_steps=100) == 100
    assert interval_steps(0.0, 3600.0, 0.5) == 1


def test_observed_mtbf() -> None:
    assert observed_mtbf_s(7200.0, 4, None) == 1800.0
    assert observed_mtbf_s(7200.0, 0, 5000.0) == 5000.0
    assert observed_mtbf_s(7200.0, 0, None) == DEFAULT_MTBF_S


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="MTBF 0"):
        young_daly_interval_s(1.0, 0)
