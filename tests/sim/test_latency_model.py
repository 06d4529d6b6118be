"""policies/latency.py: HyperFlexis eq.(1)/(2) and the mixed-batch rule."""

from __future__ import annotations

import pytest

from policies.latency import LatencyCoefficients, batch_step_time, decode_step_time, prefill_time

C = LatencyCoefficients(a=0.02, b=1e-4, c=1e-9, a_d=0.01, b_d=4e-8, c_d=1e-4)


def test_prefill_is_eq1() -> None:
    assert prefill_time(C, [100, 300]) == pytest.approx(0.02 + 1e-4 * 400 + 1e-9 * (100**2 + 300**2))
    assert prefill_time(C, []) == 0.0


def test_decode_is_eq2() -> None:
    assert decode_step_time(C, [1000, 2000, 3000]) == pytest.approx(0.01 + 4e-8 * 6000 + 1e-4 * 3)
    assert decode_step_time(C, []) == 0.0


@pytest.mark.parametrize(
    ("prefills", "decodes"), [([], []), ([512], []), ([], [100, 200]), ([256, 64], [100, 200, 300])]
)
def test_mixed_batch_pays_the_fixed_cost_once(prefills: list[int], decodes: list[int]) -> None:
    got = batch_step_time(C, prefills, decodes)
    if not prefills and not decodes:
        assert got == 0.0
    elif not decodes:
        assert got == pytest.approx(prefill_time(C, prefills))
    elif not prefills:
        assert got == pytest.approx(decode_step_time(C, decodes))
    else:
        expected = prefill_time(C, prefills) + decode_step_time(C, decodes) - min(C.a, C.a_d)
        assert got == pytest.approx(expected)


def test_coefficients_are_frozen() -> None:
    with pytest.raises(AttributeError):
        C.a = 1.0  # type: ignore[misc]
