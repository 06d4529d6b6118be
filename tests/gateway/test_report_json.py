"""Results files are strict JSON: a figure that is not a number is written as null."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gateway.report_json import report_json
from tests.support.strict_json import strict_json


def test_floats_that_are_not_finite_are_written_as_null_wherever_they_are() -> None:
    value = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (2, "x"), "e": None, "f": Path("p")}
    text = report_json(value, default=str)
    assert strict_json(text) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2, "x"], "e": None, "f": "p"}
    with pytest.raises(ValueError):
        strict_json('{"a": NaN}')  # (what json.dumps wrote before)
