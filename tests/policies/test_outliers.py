"""Outlier ejection's rule: how long an ejection lasts, and how many of a pool may be out."""

from __future__ import annotations

import pytest

from policies.outliers import OutlierParams, ejection_s, may_eject


def test_each_ejection_in_a_row_lasts_twice_as_long_up_to_the_cap() -> None:
    params = OutlierParams(base_ejection_s=10.0, max_ejection_s=60.0)
    assert [ejection_s(params, n) for n in (1, 2, 3, 4, 5, 1000)] == [10.0, 20.0, 40.0, 60.0, 60.0, 60.0]


@pytest.mark.parametrize(
    ("share", "out", "pool", "allowed"),
    [
        (0.5, 0, 2, True),
        (0.5, 1, 2, False),  # (half of two is one: the other stays whatever it does)
        (0.5, 0, 1, False),  # (the last engine of a pool is never ejected)
        (0.5, 1, 4, True),
        (0.5, 2, 4, False),
        (1.0, 1, 3, True),
        (1.0, 2, 3, False),  # (whatever the share, one stays)
        (0.0, 0, 10, False),
    ],
)
def test_never_more_than_the_share_of_a_pool_nor_its_last_engine(
    share: float, out: int, pool: int, allowed: bool
) -> None:
    assert may_eject(OutlierParams(max_ejected_share=share), out, pool) is allowed


def test_off_ejects_nothing_and_bad_numbers_are_refused() -> None:
    assert not may_eject(OutlierParams(consecutive_failures=0), 0, 10)
    for bad in (
        {"consecutive_failures": -1},
        {"base_ejection_s": 0.0},
        {"base_ejection_s": 9.0, "max_ejection_s": 8.0},
    ):
        with pytest.raises(ValueError):
            OutlierParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        OutlierParams(max_ejected_share=1.5)
