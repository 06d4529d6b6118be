"""Plugin registry: plugins register a factory under a kind and a name; profiles pick them.

A factory is called with the parameters from the routing profile as keyword arguments. An unknown
name, an unknown parameter or a bad value raises :class:`PolicyConfigError` with a message that
names the plugin and lists what is accepted, so start-up fails with something a user can act on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal

from policies.api import PolicyConfigError

PluginKind = Literal["filter", "scorer", "picker"]

_FACTORIES: dict[PluginKind, dict[str, Callable[..., object]]] = {
    "filter": {},
    "scorer": {},
    "picker": {},
}


def register(kind: PluginKind, name: str) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """Class or function decorator: ``@register("scorer", "least_load")``."""

    def decorate(factory: Callable[..., object]) -> Callable[..., object]:
        if name in _FACTORIES[kind]:
            raise ValueError(f"{kind} plugin {name!r} registered twice")
        _FACTORIES[kind][name] = factory
        return factory

    return decorate


def names(kind: PluginKind) -> list[str]:
    return sorted(_FACTORIES[kind])


def build(kind: PluginKind, name: str, params: Mapping[str, Any] | None = None) -> object:
    """Instantiate a registered plugin, turning every mistake into a PolicyConfigError."""
    factory = _FACTORIES[kind].get(name)
    if factory is None:
        known = ", ".join(names(kind)) or "none"
        raise PolicyConfigError(f"unknown {kind} plugin {name!r}; known {kind} plugins: {known}")
    params = dict(params or {})
    accepted = [
        p.name
        for p in inspect.signature(factory).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise PolicyConfigError(
            f"{kind} plugin {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"it accepts: {', '.join(accepted) or 'no parameters'}"
        )
    try:
        return factory(**params)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"{kind} plugin {name!r}: {exc}") from exc
