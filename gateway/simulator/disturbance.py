"""Disturbances injected into a simulated run, to see whether a policy degrades gracefully.

* ``slow-engine``: one engine (engine 0, or the one named) runs ``magnitude`` times slower
  between ``start`` and ``end`` (a CPU-starved or thermally throttled engine); the gateway is not
  told, it sees only the engine's own pace;
* ``stale-scrapes``: no scrape reaches the gateway between ``start`` and ``end`` (a monitor that
  cannot keep up); the gateway routes on its shadow and stale state;
* ``gateway-stall``: every event the gateway handles between ``start`` and ``end`` is handled
  ``magnitude`` seconds late (a CPU-starved gateway): arrivals, dispatch turns, tokens, ends;
* ``relay-delay``: the engines' tokens and ends produced between ``start`` and ``end`` reach the
  gateway ``magnitude`` seconds after the engine made them (the network and a busy relay: live,
  the gateway reads each token from an HTTP stream), in order; the client sees them as late. The
  scrapes and health checks of the window come back as late (one path, one busy event loop).

Written ``kind:start:end[:magnitude[:engine]]`` on the command line (seconds of virtual time;
``engine``, an engine id such as ``decode-1``, only for ``slow-engine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["slow-engine", "stale-scrapes", "gateway-stall", "relay-delay"]
KINDS: tuple[Kind, ...] = ("slow-engine", "stale-scrapes", "gateway-stall", "relay-delay")
DEFAULT_MAGNITUDE: dict[Kind, float] = {
    "slow-engine": 3.0,
    "stale-scrapes": 0.0,
    "gateway-stall": 0.2,
    "relay-delay": 0.02,
}


@dataclass(frozen=True, slots=True)
class Disturbance:
    kind: Kind
    start_s: float
    end_s: float
    magnitude: float
    #: slow-engine: the engine slowed (None: the first engine)
    engine: str | None = None

    def covers(self, now: float) -> bool:
        return self.start_s <= now < self.end_s

    @classmethod
    def parse(cls, text: str) -> Disturbance:
        parts = text.split(":")
        if len(parts) not in (3, 4, 5) or parts[0] not in KINDS:
            raise ValueError(
                f"disturbance {text!r}: expected kind:start:end[:magnitude[:engine]], kind one of "
                f"{', '.join(KINDS)}"
            )
        kind = parts[0]
        engine = parts[4] if len(parts) == 5 else None
        if engine is not None and (kind != "slow-engine" or not engine):
            raise ValueError(f"disturbance {text!r}: only slow-engine names an engine")
        try:
            start, end = float(parts[1]), float(parts[2])
            magnitude = float(parts[3]) if len(parts) >= 4 and parts[3] else DEFAULT_MAGNITUDE[kind]
        except ValueError:
            raise ValueError(f"disturbance {text!r}: start, end and magnitude must be numbers") from None
        if not 0 <= start < end:
            raise ValueError(f"disturbance {text!r}: need 0 <= start < end")
        if kind == "slow-engine" and magnitude <= 0:
            raise ValueError(f"disturbance {text!r}: a slow-down factor must be > 0")
        if kind in ("gateway-stall", "relay-delay") and magnitude < 0:
            raise ValueError(f"disturbance {text!r}: a stall or delay must be >= 0 seconds")
        return cls(kind, start, end, magnitude, engine)
