"""SLO profiles and request classification: which TTFT/TPOT targets a request is held to.

A profile (``profiles/slo/*.yaml``) names SLO *classes* (normally one per task, HyperFlexis
Table 1) with absolute targets and per-class queue limits, optionally maps tenants to a default
class, and optionally defines priority levels whose targets the HyperFlexis priority mapper
(:mod:`policies.priority_mapping`) derives from recent completions within per-level bounds.

:func:`classify` resolves a request's targets in this order, field by field:

1. explicit targets from the client (``x-slo-ttft-ms`` / ``x-slo-tpot-ms``, in :class:`SloHints`);
2. a task name (``x-slo-task`` or the API key's default task) naming a class of the profile;
3. a priority (``x-priority`` or the body's ``priority``; 0 highest) if the profile has levels;
4. the tenant's default class (``tenants:``);
5. the profile's ``default_class``.

A partial explicit hint (only TTFT, say) takes the missing field from the first of 2–5 that
applies. The *class* (what the gateway queues and sheds by) always comes from 2–5: explicit
numbers say how fast, not whose queue. Unknown task names and out-of-profile tenants fall
through to the next step rather than fail, so a typo degrades to the default class instead of
rejecting traffic; explicit values that are not finite and positive count as absent.

Everything here is pure: parsing takes YAML *text* (the gateway reads the file), classification
takes the hints the gateway extracted, and priority-mapping state is passed in and returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policies.api import PolicyConfigError
from policies.priority_mapping import (
    PriorityBounds,
    PriorityMappingConfig,
    PriorityMappingState,
    assign,
    initial_state,
)

# ---------------------------------------------------------------------------------------------
# Profile schema (pydantic v2). extra="forbid" so a misspelt key is an error, not a silent default.
# ---------------------------------------------------------------------------------------------

Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True)


class SloProfileError(PolicyConfigError):
    """An SLO profile is malformed; the message names the file and the offending key."""


class QueueLimits(BaseModel):
    """How the gateway sheds a class: at most ``max_queued`` waiting, none longer than ``timeout_s``."""

    model_config = _MODEL_CONFIG

    max_queued: int = Field(ge=1)
    timeout_s: Seconds


class SloClass(BaseModel):
    """Fixed targets for one class (task), seconds."""

    model_config = _MODEL_CONFIG

    ttft_s: Seconds
    tpot_s: Seconds
    queue: QueueLimits
    description: str = ""


def _check_range(value: tuple[float, float]) -> tuple[float, float]:
    low, high = value
    if low > high:
        raise ValueError(f"range must be [min, max] with min <= max, got [{low}, {high}]")
    return value


class PriorityLevel(BaseModel):
    """Bounds ``[min, max]`` (seconds) for one priority level; its list position is the priority."""

    model_config = _MODEL_CONFIG

    name: str = Field(min_length=1)
    ttft_s: tuple[Seconds, Seconds]
    tpot_s: tuple[Seconds, Seconds]
    queue: QueueLimits
    description: str = ""

    @field_validator("ttft_s", "tpot_s")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        return _check_range(value)

    def bounds(self) -> PriorityBounds:
        return PriorityBounds(self.ttft_s[0], self.ttft_s[1], self.tpot_s[0], self.tpot_s[1])


class PriorityProfile(BaseModel):
    """The priority mapper's configuration: ``levels[0]`` is the highest priority."""

    model_config = _MODEL_CONFIG

    window: int = Field(ge=1, le=100_000)
    levels: tuple[PriorityLevel, ...] = Field(min_length=1)

    def mapping_config(self) -> PriorityMappingConfig:
        return PriorityMappingConfig(tuple(level.bounds() for level in self.levels), self.window)


class SloProfile(BaseModel):
    """A whole SLO profile file. See ``profiles/slo/*.yaml`` for commented examples."""

    model_config = _MODEL_CONFIG

    version: Literal[1] = 1
    name: str = Field(min_length=1)
    description: str = ""
    default_class: str
    classes: dict[str, SloClass] = Field(min_length=1)
    tenants: dict[str, str] = Field(default_factory=dict)
    priority: PriorityProfile | None = None

    @model_validator(mode="after")
    def _references(self) -> SloProfile:
        # messages start with the key so the formatted error names it even without a loc
        known = ", ".join(sorted(self.classes))
        if self.default_class not in self.classes:
            raise ValueError(f"default_class: {self.default_class!r} is not in classes (defined: {known})")
        for tenant, cls in self.tenants.items():
            if cls not in self.classes:
                raise ValueError(f"tenants.{tenant}: class {cls!r} is not in classes (defined: {known})")
        if self.priority is not None:
            seen: set[str] = set()
            for i, level in enumerate(self.priority.levels):
                if level.name in self.classes or level.name in seen:
                    raise ValueError(
                        f"priority.levels.{i}.name: {level.name!r} is already used by a class or level; "
                        "level names are queue classes and must be unique"
                    )
                seen.add(level.name)
        return self

    @property
    def tightest_ttft_s(self) -> float:
        """The tightest TTFT a request can be given: any class's, or the floor of any priority
        level (Algorithm 2 can assign down to it). The dispatcher budgets against it so that work
        handed out while only lax requests wait cannot block the next strict arrival."""
        targets = [c.ttft_s for c in self.classes.values()]
        if self.priority is not None:
            targets += [level.ttft_s[0] for level in self.priority.levels]
        return min(targets)

    def class_ttft_s(self, slo_class: str) -> float | None:
        """The TTFT a class or priority level stands for (a level's upper bound); None if unknown."""
        if slo_class in self.classes:
            return self.classes[slo_class].ttft_s
        if self.priority is not None:
            for level in self.priority.levels:
                if level.name == slo_class:
                    return level.ttft_s[1]
        return None

    def queue_limits(self, slo_class: str) -> QueueLimits:
        """Queue limits of a class or priority level by name (``SloTarget.slo_class``)."""
        if slo_class in self.classes:
            return self.classes[slo_class].queue
        if self.priority is not None:
            for level in self.priority.levels:
                if level.name == slo_class:
                    return level.queue
        raise KeyError(slo_class)


def _format_errors(error: ValidationError, source: str) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        msg = str(item["msg"]).removeprefix("Value error, ")
        got = item.get("input")
        shown = "" if key == "" or isinstance(got, dict | list) else f" (got {got!r})"
        lines.append(f"  {key}: {msg}{shown}" if key else f"  {msg}")
    return f"{source}: invalid SLO profile:\n" + "\n".join(lines)


def slo_profile_from_mapping(data: Mapping[str, Any], source: str = "<slo profile>") -> SloProfile:
    """Validate an already-parsed profile. Raises :class:`SloProfileError` naming every bad key."""
    try:
        return SloProfile.model_validate(dict(data))
    except ValidationError as error:
        raise SloProfileError(_format_errors(error, source)) from None


def parse_slo_profile(text: str, source: str = "<slo profile>") -> SloProfile:
    """Parse and validate YAML text; ``source`` (usually the file path) prefixes every message."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SloProfileError(f"{source}: not valid YAML: {error}") from None
    if not isinstance(data, Mapping):
        raise SloProfileError(f"{source}: an SLO profile must be a mapping, got {type(data).__name__}")
    return slo_profile_from_mapping(data, source)


# ---------------------------------------------------------------------------------------------
# Classification
# ---------------------------------------------------------------------------------------------


class SloSource(StrEnum):
    """Where a target came from; low-cardinality, fit for a metric label."""

    EXPLICIT = "explicit"
    TASK = "task"
    PRIORITY = "priority"
    TENANT = "tenant"
    DEFAULT = "default"


@dataclass(frozen=True, slots=True)
class SloHints:
    """What the gateway extracted from one request; every field optional.

    ``ttft_ms``/``tpot_ms``: the client's explicit targets in milliseconds. ``task``: from
    ``x-slo-task`` or the API key's default task. ``priority``: from ``x-priority`` or the body,
    0 highest; values beyond the profile's levels are clamped into range. ``tenant``: whose
    default class applies when nothing more specific does.
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    task: str | None = None
    priority: int | None = None
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class SloTarget:
    """The targets a request is held to, seconds, and the queue class it belongs to.

    ``source`` says where ``ttft_s`` came from; ``tpot_source`` where ``tpot_s`` came from when
    that differs (a partial explicit hint), ``None`` when it is the same as ``source``.
    """

    ttft_s: float
    tpot_s: float
    slo_class: str
    source: SloSource
    tpot_source: SloSource | None = None


@dataclass(frozen=True, slots=True)
class _Fallback:
    source: SloSource
    slo_class: str
    ttft_s: float
    tpot_s: float
    priority: int | None = None


def _explicit_seconds(ms: float | None) -> float | None:
    if ms is None or not math.isfinite(ms) or ms <= 0:
        return None
    seconds = ms / 1000.0
    # (a positive millisecond count can be 0.0 seconds: 5e-324 ms held every worker carrying it
    # for max_hold_s, as a target of nothing; ignored like any target that is not one)
    return seconds if seconds > 0.0 else None


def _fallback(hints: SloHints, profile: SloProfile) -> _Fallback:
    """Steps 2–5 of the resolution order, with static targets for the priority step."""
    if hints.task is not None and hints.task in profile.classes:
        cls = profile.classes[hints.task]
        return _Fallback(SloSource.TASK, hints.task, cls.ttft_s, cls.tpot_s)
    if hints.priority is not None and profile.priority is not None:
        levels = profile.priority.levels
        p = min(max(hints.priority, 0), len(levels) - 1)
        bounds = levels[p].bounds()
        # static midpoint: what the mapper gives with an empty window (see priority_mapping)
        return _Fallback(SloSource.PRIORITY, levels[p].name, bounds.ttft_mid_s, bounds.tpot_mid_s, p)
    if hints.tenant is not None and hints.tenant in profile.tenants:
        name = profile.tenants[hints.tenant]
        cls = profile.classes[name]
        return _Fallback(SloSource.TENANT, name, cls.ttft_s, cls.tpot_s)
    cls = profile.classes[profile.default_class]
    return _Fallback(SloSource.DEFAULT, profile.default_class, cls.ttft_s, cls.tpot_s)


def _no_backlog() -> bool:
    return False


def _resolve(
    hints: SloHints,
    profile: SloProfile,
    state: PriorityMappingState | None,
    backlog: Callable[[], bool] = _no_backlog,
) -> tuple[SloTarget, PriorityMappingState | None]:
    ttft = _explicit_seconds(hints.ttft_ms)
    tpot = _explicit_seconds(hints.tpot_ms)
    fb = _fallback(hints, profile)
    if ttft is not None and tpot is not None:
        return SloTarget(ttft, tpot, fb.slo_class, SloSource.EXPLICIT), state
    fb_ttft, fb_tpot = fb.ttft_s, fb.tpot_s
    # the mapper only runs when its answer is used: assign() moves last_queue_time
    if fb.priority is not None and state is not None:
        mapped, state = assign(state, fb.priority, backlog())
        fb_ttft, fb_tpot = mapped.ttft_s, mapped.tpot_s
    if ttft is not None:
        return SloTarget(ttft, fb_tpot, fb.slo_class, SloSource.EXPLICIT, fb.source), state
    if tpot is not None:
        return SloTarget(fb_ttft, tpot, fb.slo_class, fb.source, SloSource.EXPLICIT), state
    return SloTarget(fb_ttft, fb_tpot, fb.slo_class, fb.source), state


def initial_priority_state(profile: SloProfile) -> PriorityMappingState | None:
    """An empty priority-mapping state for ``profile``, ``None`` when it defines no priority levels."""
    return None if profile.priority is None else initial_state(profile.priority.mapping_config())


def classify(hints: SloHints, profile: SloProfile) -> SloTarget:
    """Targets for a request with static priority targets (each level's range midpoint).

    Use :func:`classify_mapped` when the profile's priority levels should follow the fleet
    through the HyperFlexis mapper.
    """
    target, _ = _resolve(hints, profile, None)
    return target


def classify_mapped(
    hints: SloHints,
    profile: SloProfile,
    state: PriorityMappingState,
    backlog: Callable[[], bool] = _no_backlog,
) -> tuple[SloTarget, PriorityMappingState]:
    """Like :func:`classify`, but priority targets come from Algorithm 2 over ``state``
    (``backlog``: whether requests wait for an engine, see
    :func:`policies.priority_mapping.assign`; asked only when the mapper runs).

    ``state`` must come from :func:`initial_priority_state` for this profile (then threaded
    through ``classify_mapped`` and :func:`policies.priority_mapping.observe_completion`). The returned
    state is ``state`` itself unless the priority step supplied a target.
    """
    target, new_state = _resolve(hints, profile, state, backlog)
    return target, state if new_state is None else new_state
