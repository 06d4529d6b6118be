"""llm-d-style flow control: the fair rounds behind the ``flow_control`` order, and shedding under
saturation.

Two pure pieces, no I/O and no clock:

* :class:`FlowRounds` numbers the rounds the :class:`~policies.queue_order.FlowControl` order
  ranks by. The admission queue owns one (for orders with ``uses_flows``), calls
  :meth:`FlowRounds.admit` on every push and :meth:`FlowRounds.leave` whenever a request leaves
  (dispatched, removed, expired), and re-keys the requests they name.
* :func:`saturated` and :func:`shed_victim` decide, when a request arrives and must queue,
  whether the model's pool is saturated and, if so, which request to refuse: the least urgent
  band's newest (the arrival itself when it is in the least urgent band). The dispatch core calls
  them on submit (``DispatchCore(shedding=...)``) and refuses the victim with a 429.

Fair rounds. A *flow* is one tenant's requests in one priority band; llm-d keeps one queue per
flow, serves the bands strictly and the flows of a band round robin, and orders each flow by
deadline. Here one ordered queue does the same: only each flow's *head*, its earliest-deadline
request, carries a round (``flow_round``); the flow's other requests are *parked*
(``flow_round = inf``: after every head of their band, by deadline). The heads' rounds follow
start-time fair queueing with one request per round: each band keeps a virtual time ``V``, the
largest round of a head that left the queue (served, expired or cancelled); a flow that starts
(had nothing queued) starts at ``max(V, next)``, where ``next`` is one past its last round if it
emptied recently; when a head leaves, the flow's next request by deadline becomes its head one
round later. So the first request in order is exactly llm-d's choice: the most urgent band, in it
the flows' heads round robin (a newly active tenant joins the current round instead of waiting
behind another tenant's backlog), each flow's head its earliest deadline. Requests past the heads
are in an approximate order (the next rounds, cross-tenant by deadline), which only a reader of
the queue's head beyond its first request sees. An arrival due before its flow's head takes the
head's place and round (the old head is parked): at most two re-keys per arrival and one per
departure. A band's state is dropped when its last flow empties, so memory is O(queued requests).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.api import EngineSnapshot
from policies.queue_order import OrderContext, QueuedRequest, with_flow_round

#: the round of a parked request (not its flow's head): after every head of its band
PARKED = math.inf


class _Flow:
    """One tenant's queued requests in one band: the head (earliest deadline) and the rest."""

    __slots__ = ("head", "head_key", "parked", "parked_ids", "round")

    def __init__(self, flow_round: float, head: str, head_key: tuple[float, int]) -> None:
        self.round = flow_round
        self.head = head
        self.head_key = head_key
        #: (deadline, seq, id) of the parked requests; ids that left are dropped as they surface
        self.parked: list[tuple[float, int, str]] = []
        self.parked_ids: set[str] = set()


class _Band:
    __slots__ = ("flows", "restart", "vtime")

    def __init__(self) -> None:
        self.vtime = 0.0
        self.flows: dict[str, _Flow] = {}
        #: tenant -> one past its last round, for flows that emptied ahead of ``vtime``
        self.restart: dict[str, float] = {}


class FlowRounds:
    """Rounds for the ``flow_control`` order (see the module docstring): pure bookkeeping over the
    queued requests' ids. The caller stores the stamped arrival and re-keys the requests that
    :meth:`admit` and :meth:`leave` return with their new ``flow_round``."""

    __slots__ = ("_bands",)

    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}

    def __len__(self) -> int:
        """Requests tracked (for tests: equals the queue's length)."""
        return sum(1 + len(f.parked_ids) for b in self._bands.values() for f in b.flows.values())

    def virtual_time(self, band: int) -> float:
        """The band's virtual time ``V`` (0 for a band with nothing queued)."""
        state = self._bands.get(band)
        return 0.0 if state is None else state.vtime

    def admit(self, item: QueuedRequest) -> tuple[QueuedRequest, list[tuple[str, float]]]:
        """Number an arriving request (its id must not be tracked already): the request stamped
        with its round, and the queued request it displaces as its flow's head, now parked
        (``[(id, PARKED)]``, or ``[]``)."""
        view = item.view
        band = self._bands.get(view.priority)
        if band is None:
            band = self._bands[view.priority] = _Band()
        tenant = view.tenant
        rid = view.request_id
        key = (view.arrival + item.ttft_slo, item.seq)
        flow = band.flows.get(tenant)
        if flow is None:
            start = band.vtime
            restart = band.restart.pop(tenant, None)
            if restart is not None and restart > start:
                start = restart
            band.flows[tenant] = _Flow(start, rid, key)
            return with_flow_round(item, start), []
        if key < flow.head_key:  # due before the flow's head: it leads the flow now
            displaced = flow.head
            self._park(flow, displaced, flow.head_key)
            flow.head, flow.head_key = rid, key
            return with_flow_round(item, flow.round), [(displaced, PARKED)]
        self._park(flow, rid, key)
        return with_flow_round(item, PARKED), []

    def leave(self, item: QueuedRequest) -> list[tuple[str, float]]:
        """The request left the queue (any way): ``[(id, round)]`` for the request that becomes
        its flow's head in its place (one round later), or ``[]``. Unknown requests are ignored."""
        view = item.view
        band = self._bands.get(view.priority)
        flow = None if band is None else band.flows.get(view.tenant)
        if band is None or flow is None:
            return []
        rid = view.request_id
        if rid != flow.head:
            flow.parked_ids.discard(rid)
            return []
        if flow.round > band.vtime:
            band.vtime = flow.round
        parked = flow.parked
        while parked:
            deadline, seq, next_id = heapq.heappop(parked)
            if next_id in flow.parked_ids:
                flow.parked_ids.discard(next_id)
                flow.head, flow.head_key = next_id, (deadline, seq)
                flow.round += 1.0
                return [(next_id, flow.round)]
        del band.flows[view.tenant]
        if not band.flows:
            del self._bands[view.priority]  # nothing queued in the band: its rounds restart
            return []
        if flow.round + 1.0 > band.vtime:
            band.restart[view.tenant] = flow.round + 1.0
        if len(band.restart) > 64 + 2 * len(band.flows):
            band.restart = {t: r for t, r in band.restart.items() if r > band.vtime}
        return []

    @staticmethod
    def _park(flow: _Flow, rid: str, key: tuple[float, int]) -> None:
        heapq.heappush(flow.parked, (key[0], key[1], rid))
        flow.parked_ids.add(rid)
        if len(flow.parked) > 64 + 2 * len(flow.parked_ids):
            flow.parked = [e for e in flow.parked if e[2] in flow.parked_ids]
            heapq.heapify(flow.parked)


# -- shedding under saturation --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SheddingParams:
    """When a model's pool counts as saturated, and what may be shed.

    ``max_queue_s``: the pool is saturated when no engine can take a request (every engine at the
    gateway's per-engine load cap) and the prefill work queued for the model, an arrival included,
    exceeds this many seconds of the pool's prefill capacity. 0: any queueing at all.
    ``min_band``: only requests of this band or less urgent ones (``priority >= min_band``) are
    ever shed; ``None``: any band (the least urgent band queued goes first in any case).
    """

    max_queue_s: float = 10.0
    min_band: int | None = None

    def __post_init__(self) -> None:
        value = self.max_queue_s
        if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value < math.inf):
            raise ValueError(f"max_queue_s must be a finite number of seconds >= 0, got {value!r}")
        band = self.min_band
        if band is not None and (isinstance(band, bool) or not isinstance(band, int)):
            raise ValueError(f"min_band must be an integer priority or null, got {band!r}")


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """One model's pool as the gateway sees it when a request arrives.

    ``engines``: the healthy engines serving the model (their ``load`` is the estimated count of
    requests queued or running on each, :func:`policies.api.estimated_load`); ``max_engine_load``:
    the gateway's per-engine cap, ``None`` when there is none (engines are then never full and the
    pool is judged by its queue alone). ``queued`` / ``queued_prompt_tokens``: what waits in the
    gateway's queue for the model, the arriving request included.
    """

    engines: Sequence[EngineSnapshot]
    max_engine_load: int | None
    queued: int
    queued_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ShedCandidate:
    """A request that may be shed: its id, band (``priority``) and admission number."""

    request_id: str
    band: int
    seq: int


def queued_prefill_s(pool: PoolLoad, ctx: OrderContext) -> float:
    """Seconds the pool needs to prefill what is queued, its engines working in parallel
    (``inf`` with no engine): ``(queued * base + tokens / rate) / engines``."""
    engines = len(pool.engines)
    if engines == 0:
        return math.inf
    work = pool.queued * ctx.prefill_base_s + pool.queued_prompt_tokens / ctx.prefill_tokens_per_s
    return work / engines


def saturated(pool: PoolLoad, ctx: OrderContext, params: SheddingParams) -> bool:
    """No engine has room (every one at the cap) and the queued prefill work exceeds
    ``params.max_queue_s``. The queue is looked at first: O(1) unless it is long."""
    if queued_prefill_s(pool, ctx) <= params.max_queue_s:
        return False
    cap = pool.max_engine_load
    return cap is None or all(e.load >= cap for e in pool.engines)


def shed_victim(
    params: SheddingParams, newcomer: ShedCandidate, least_urgent: ShedCandidate | None
) -> ShedCandidate | None:
    """Which request to refuse as ``newcomer`` arrives at a :func:`saturated` pool, or ``None``.

    The least urgent band's newest request goes: ``least_urgent`` is the newest queued request of
    the least urgent band queued (``None`` when nothing is queued); the newcomer is newer than
    every queued request, so it is the victim whenever its band is at least as low. A victim more
    urgent than ``params.min_band`` is protected: nothing is shed.
    """
    victim = newcomer
    if least_urgent is not None and (least_urgent.band, least_urgent.seq) > (newcomer.band, newcomer.seq):
        victim = least_urgent
    if params.min_band is not None and victim.band < params.min_band:
        return None
    return victim
