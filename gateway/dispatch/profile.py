"""The dispatcher part of a routing profile: which dispatcher, its parameters, the queue order,
what the profile expects of the engines' own scheduling, and shedding under saturation.

```yaml
dispatcher: {name: hyperflexis, params: {theta: 0.5}}   # or {name: pipeline} (the default)
queue_order: {name: sedf, params: {}}                    # any name in policies.queue_order.ORDERS
engine_scheduling: deadline                              # or default (the default)
shedding: {max_queue_s: 2.0, min_band: null}             # absent: no saturation shedding
disaggregation: {mode: conditional, min_prompt_tokens: 256, max_cached_fraction: 0.5}
decode_placement: {transfer_tokens_per_s: 5.0e4, transfer_latency_s: 0.001}
kv_transfer: {order: rmlq, max_per_engine: 2, levels: 4}        # absent: transfers not gated
```

Either dispatcher also takes ``max_engine_load`` (requests one engine may hold before the rest
queue in the gateway), used when the gateway's settings set none: orders and shedding only act
on a queue, and a pipeline profile without a cap never queues. ``engine_scheduling: deadline``
says the profile relies on the engines ordering their own queues by the TTFT deadline the gateway
forwards as the request's ``priority`` (vLLM ``--scheduling-policy priority``, SGLang priority
scheduling): drivers that start engines (the simulator, the experiment runner) start them so, and
the gateway warns at start-up about configured engines that are not. ``disaggregation`` and
``decode_placement`` apply to models served by prefill and decode engines (see docs/pd.md).
See docs/routing-profiles.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, cast

from policies.api import PolicyConfigError
from policies.decode_placement import DecodePlacementParams
from policies.disaggregation import DisaggregationMode, DisaggregationParams
from policies.flow_control import SheddingParams
from policies.hyperflexis import HyperFlexisParams
from policies.queue_order import QueueOrder, make_order

DISPATCHERS = ("pipeline", "hyperflexis")
EngineScheduling = Literal["default", "deadline"]
ENGINE_SCHEDULING: tuple[EngineScheduling, ...] = ("default", "deadline")


@dataclass(frozen=True, slots=True)
class TransferGateConfig:
    """How decode stages share a decode engine's KV ingress (gateway.dispatch.transfer_gate)."""

    #: ``rmlq`` (MFS reverse multi-level queue) or ``fifo``
    order: str = "rmlq"
    #: transfers in flight into one decode engine; the rest wait in ``order``
    max_per_engine: int = 2
    #: RMLQ levels (K)
    levels: int = 4

    def __post_init__(self) -> None:
        if self.order not in ("rmlq", "fifo"):
            raise ValueError(f"order must be rmlq or fifo, got {self.order!r}")
        if (
            isinstance(self.max_per_engine, bool)
            or not isinstance(self.max_per_engine, int)
            or self.max_per_engine < 1
        ):
            raise ValueError("max_per_engine must be an integer >= 1")
        if isinstance(self.levels, bool) or not isinstance(self.levels, int) or self.levels < 2:
            raise ValueError("levels must be an integer >= 2")


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    hyperflexis: HyperFlexisParams | None
    order: QueueOrder
    #: what the profile expects of the engines' own queues: ``deadline`` = priority scheduling
    #: fed with each request's TTFT deadline (``EngineConfig.priority_scheduling``)
    engine_scheduling: EngineScheduling = "default"
    #: requests one engine may hold (the rest queue in the gateway) when the settings set none
    max_engine_load: int | None = None
    #: saturation shedding (llm-d flow control); ``None``: none
    shedding: SheddingParams | None = None
    #: which requests of a P/D-served model go through the prefill pool
    disaggregation: DisaggregationParams = field(default_factory=DisaggregationParams)
    #: the decode stage's link model and decode token budget
    decode_placement: DecodePlacementParams = field(default_factory=DecodePlacementParams)
    #: KV-transfer gating per decode engine; ``None``: decode requests go at once
    kv_transfer: TransferGateConfig | None = None

    @property
    def deadline_engines(self) -> bool:
        """The profile expects engines that schedule by the forwarded TTFT deadline."""
        return self.engine_scheduling == "deadline"


def _entry(profile: Mapping[str, Any], key: str, default: str) -> tuple[str, dict[str, Any]]:
    value = profile.get(key) or {"name": default}
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        raise PolicyConfigError(f"routing profile {key!r} must be {{name: ..., params: {{...}}}}")
    extra = sorted(map(str, set(value) - {"name", "params"}))
    if extra:
        # (max_engine_load beside params, not in it, left the queue without its cap, unsaid)
        raise PolicyConfigError(f"routing profile {key!r} has unknown keys {extra}; allowed: name, params")
    params = value.get("params") or {}
    if not isinstance(params, Mapping):
        raise PolicyConfigError(f"routing profile {key}.params must be a mapping")
    return value["name"], dict(params)


def _max_engine_load(name: str, params: dict[str, Any]) -> int | None:
    value: object = params.pop("max_engine_load", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyConfigError(
            f"dispatcher {name!r}: max_engine_load must be an integer >= 1 or null, got {value!r}"
        )
    return value


def _engine_scheduling(profile: Mapping[str, Any]) -> EngineScheduling:
    value = profile.get("engine_scheduling", "default")
    if value not in ENGINE_SCHEDULING:
        raise PolicyConfigError(
            f"routing profile 'engine_scheduling' must be one of {', '.join(ENGINE_SCHEDULING)}, "
            f"got {value!r}"
        )
    return cast(EngineScheduling, value)


def _shedding(profile: Mapping[str, Any]) -> SheddingParams | None:
    value = profile.get("shedding")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise PolicyConfigError(
            "routing profile 'shedding' must be a mapping {max_queue_s: ..., min_band: ...}"
        )
    accepted = {f.name for f in fields(SheddingParams)}
    unknown = sorted(set(value) - accepted)
    if unknown:
        raise PolicyConfigError(f"shedding has no parameter {unknown}; it accepts: {sorted(accepted)}")
    try:
        return SheddingParams(**value)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"shedding: {exc}") from None


def _section(profile: Mapping[str, Any], key: str, kind: Any) -> Any:
    """A flat parameter section made into ``kind`` (a dataclass), with messages that say how to
    fix it; an absent section is ``kind()``."""
    value = profile.get(key)
    if value is None:
        return kind()
    if not isinstance(value, Mapping):
        raise PolicyConfigError(f"routing profile {key!r} must be a mapping of parameters")
    accepted = {f.name for f in fields(kind)}
    unknown = sorted(set(value) - accepted)
    if unknown:
        raise PolicyConfigError(f"{key} has no parameter {unknown}; it accepts: {sorted(accepted)}")
    params = dict(value)
    if kind is DisaggregationParams and "mode" in params:
        modes = [m.value for m in DisaggregationMode]
        if params["mode"] not in modes:
            raise PolicyConfigError(f"disaggregation.mode must be one of {modes}, got {params['mode']!r}")
        params["mode"] = DisaggregationMode(params["mode"])
    try:
        return kind(**params)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"{key}: {exc}") from None


def dispatcher_config(profile: Mapping[str, Any]) -> DispatcherConfig:
    name, params = _entry(profile, "dispatcher", "pipeline")
    if name not in DISPATCHERS:
        raise PolicyConfigError(f"unknown dispatcher {name!r}; known: {', '.join(DISPATCHERS)}")
    max_engine_load = _max_engine_load(name, params)
    hyperflexis = None
    if name == "hyperflexis":
        accepted = {f.name for f in fields(HyperFlexisParams)}
        unknown = sorted(set(params) - accepted)
        if unknown:
            raise PolicyConfigError(
                f"dispatcher 'hyperflexis' has no parameter {unknown}; "
                f"it accepts: {sorted(accepted | {'max_engine_load'})}"
            )
        try:
            hyperflexis = HyperFlexisParams(**params)
        except (TypeError, ValueError) as exc:
            raise PolicyConfigError(f"dispatcher 'hyperflexis': {exc}") from None
    elif params:
        raise PolicyConfigError(
            "dispatcher 'pipeline' takes only max_engine_load (its plugins are the filters/scorers/picker)"
        )
    order_name, order_params = _entry(profile, "queue_order", "slo_tpot" if hyperflexis else "fcfs")
    order = make_order(order_name, order_params)
    if hyperflexis is not None and hyperflexis.demote_longest and not getattr(order, "uses_demotion", False):
        raise PolicyConfigError(
            f"dispatcher 'hyperflexis': demote_longest needs a queue order that ranks demoted "
            f"requests last (slo_tpot), not {order_name!r}"
        )
    return DispatcherConfig(
        hyperflexis,
        order,
        engine_scheduling=_engine_scheduling(profile),
        max_engine_load=max_engine_load,
        shedding=_shedding(profile),
        disaggregation=_section(profile, "disaggregation", DisaggregationParams),
        decode_placement=_section(profile, "decode_placement", DecodePlacementParams),
        kv_transfer=None
        if profile.get("kv_transfer") is None
        else _section(profile, "kv_transfer", TransferGateConfig),
    )
