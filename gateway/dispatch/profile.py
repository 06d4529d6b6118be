"""The dispatcher part of a routing profile: which dispatcher, its parameters, the queue order.

```yaml
dispatcher: {name: hyperflexis, params: {theta: 0.5}}   # or {name: pipeline} (the default)
queue_order: {name: sedf, params: {}}                    # any name in policies.queue_order.ORDERS
```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from policies.api import PolicyConfigError
from policies.hyperflexis import HyperFlexisParams
from policies.queue_order import QueueOrder, make_order

DISPATCHERS = ("pipeline", "hyperflexis")


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    hyperflexis: HyperFlexisParams | None
    order: QueueOrder


def _entry(profile: Mapping[str, Any], key: str, default: str) -> tuple[str, dict[str, Any]]:
    value = profile.get(key) or {"name": default}
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        raise PolicyConfigError(f"routing profile {key!r} must be {{name: ..., params: {{...}}}}")
    params = value.get("params") or {}
    if not isinstance(params, Mapping):
        raise PolicyConfigError(f"routing profile {key}.params must be a mapping")
    return value["name"], dict(params)


def dispatcher_config(profile: Mapping[str, Any]) -> DispatcherConfig:
    name, params = _entry(profile, "dispatcher", "pipeline")
    if name not in DISPATCHERS:
        raise PolicyConfigError(f"unknown dispatcher {name!r}; known: {', '.join(DISPATCHERS)}")
    hyperflexis = None
    if name == "hyperflexis":
        accepted = {f.name for f in fields(HyperFlexisParams)}
        unknown = sorted(set(params) - accepted)
        if unknown:
            raise PolicyConfigError(
                f"dispatcher 'hyperflexis' has no parameter {unknown}; it accepts: {sorted(accepted)}"
            )
        try:
            hyperflexis = HyperFlexisParams(**params)
        except (TypeError, ValueError) as exc:
            raise PolicyConfigError(f"dispatcher 'hyperflexis': {exc}") from None
    elif params:
        raise PolicyConfigError(
            "dispatcher 'pipeline' takes no parameters (its plugins are the filters/scorers/picker)"
        )
    order_name, order_params = _entry(profile, "queue_order", "slo_tpot" if hyperflexis else "fcfs")
    return DispatcherConfig(hyperflexis, make_order(order_name, order_params))
