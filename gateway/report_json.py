"""Results files (experiments, benchmarks) as strict JSON.

``json.dumps`` writes a float that is not finite as ``NaN`` or ``Infinity``, which is not JSON:
strict readers (jq, JavaScript's ``JSON.parse``, most dashboards) refuse the whole file. A cell
that served nothing has NaN latencies, a recovery that never came is infinite: written here as
``null``, "no figure".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def report_json(value: Any, indent: int | None = 2, default: Callable[[Any], Any] | None = None) -> str:
    """``value`` as strict JSON text, floats that are not finite written as ``null``."""
    return json.dumps(_finite(value), indent=indent, default=default, allow_nan=False)
