"""Reading a results file as a strict JSON reader (jq, a browser) would: NaN and Infinity are not
JSON, and such a reader refuses the whole file."""

from __future__ import annotations

import json
from typing import Any


def _refuse(constant: str) -> Any:
    raise ValueError(f"not JSON: {constant}")


def strict_json(text: str) -> Any:
    return json.loads(text, parse_constant=_refuse)
