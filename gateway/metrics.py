"""Every Prometheus metric the gateway exports, defined in this one place.

All metrics live in :data:`REGISTRY` (not prometheus_client's global one) so tests and several
apps in one process do not collide. Label values are engine ids, model names and fixed enums,
never request data, to keep cardinality bounded.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

# The *_created series double the exposition size and no dashboard uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]

REGISTRY = CollectorRegistry(auto_describe=True)
_log = logging.getLogger("slogate.metrics")


@functools.lru_cache(maxsize=4096)
def child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, cached: the hot path pays a dict lookup, not label validation."""
    return metric.labels(*labels)


# -- deferred updates, for the dispatch path ----------------------------------------------------
#
# A placement made several histogram observations and gauge moves, each taking a lock and (for a
# histogram) walking its buckets in Python. A deferred child gathers them in plain Python numbers
# and folds them into its Prometheus child when the registry is collected (a scrape, a test's
# read): the same series with the same counts and sums, paid once per scrape instead of once per
# update. Deferred children are updated on the event-loop thread only; a collection may come from
# another thread (a test reading the registry of a gateway it runs in a thread). So a flush first
# takes what has gathered and resets it with no call in between (nothing can switch threads
# there in CPython), then folds it in, and an update reads its slot with no call in between: an
# update lands either in what a flush took or in what the next one takes, never in neither.


class DeferredHistogram:
    """``observe`` like a histogram child's; the counts reach the child at the next collection."""

    __slots__ = ("_bounds", "_child", "_counts", "_pending", "_sum")

    def __init__(self, histogram_child: Any) -> None:
        self._child = histogram_child
        self._bounds: tuple[float, ...] = tuple(histogram_child._upper_bounds)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = False

    def observe(self, amount: float) -> None:
        if amount == amount:  # (NaN lands in no bucket, as in the child)
            # the first bucket whose upper bound is >= amount, as Histogram.observe picks it
            # (found before the counts are read: see the note above)
            i = bisect.bisect_left(self._bounds, amount)
            self._counts[i] += 1
        self._sum += amount
        self._pending = True

    def flush(self) -> None:
        if not self._pending:
            return
        self._pending = False  # (first: an update from here on is flushed next time)
        fresh = [0] * len(self._bounds)
        counts, self._counts = self._counts, fresh
        total, self._sum = self._sum, 0.0
        buckets = self._child._buckets
        for i, count in enumerate(counts):
            if count:
                buckets[i].inc(count)
        self._child._sum.inc(total)


class DeferredGauge:
    """``inc`` / ``dec`` like a gauge child's; the net move reaches the child at the next collection."""

    __slots__ = ("_child", "_delta")

    def __init__(self, gauge_child: Any) -> None:
        self._child = gauge_child
        self._delta = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self._delta += amount

    def dec(self, amount: float = 1.0) -> None:
        self._delta -= amount

    def flush(self) -> None:
        delta, self._delta = self._delta, 0.0
        if delta:
            self._child.inc(delta)


_deferred: list[DeferredHistogram | DeferredGauge] = []


@functools.cache  # (label sets come from configuration: models, engines, classes, routes; one
# evicted and made again would leave its old child in _deferred, which would grow for good)
def deferred(metric: Any, *labels: str) -> Any:
    """The deferred child of a histogram, gauge or counter for ``labels`` (one per label set; a
    counter's only goes up)."""
    target = metric.labels(*labels)
    made = DeferredHistogram(target) if isinstance(metric, Histogram) else DeferredGauge(target)
    _deferred.append(made)
    return made


def flush_deferred() -> None:
    """Fold every deferred update into its child (done before each collection of REGISTRY). One
    child's failure (a bug: say a counter given a negative move) drops what it had gathered and
    is logged; the others and the collection go on, rather than every scrape failing from then."""
    for pending in _deferred:
        try:
            pending.flush()
        except Exception:
            _log.exception("a deferred metric update could not be folded in")


_collect_registry = REGISTRY.collect


def _collect_flushed() -> Iterator[Any]:
    """REGISTRY's collection (scrapes, reads), with every deferred update folded in first."""
    flush_deferred()
    yield from _collect_registry()


REGISTRY.collect = _collect_flushed  # type: ignore[method-assign]


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
_FAST_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 5e-3, 0.025)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_OVERHEAD_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_PAUSE_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

REQUESTS = Counter(
    "slogate_requests",
    "Requests answered, by route, model, SLO class and HTTP status class (2xx..5xx; 499: the client "
    "left). model is '-' before the body was read and '(unknown)' for a model not served; slo_class "
    "is '-' before the request was classified",
    ["route", "model", "slo_class", "status"],
    registry=REGISTRY,
)
REQUEST_LATENCY = Histogram(
    "slogate_request_duration_seconds",
    "End to end: time from request arrival to the last byte sent, successful requests (< 400)",
    ["model", "slo_class"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TTFT = Histogram(
    "slogate_time_to_first_token_seconds",
    "Time from arrival to the first streamed event relayed to the client",
    ["model", "slo_class"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TPOT = Histogram(
    "slogate_time_per_output_token_seconds",
    "Inter-token latency of a completed stream: (last content event - first) / (engine steps - 1), "
    "a step being one event per choice (n, prompts of a batch); observed once per stream of at "
    "least two steps (the TPOT its SLO is judged by)",
    ["model", "slo_class"],
    buckets=_TPOT_BUCKETS,
    registry=REGISTRY,
)
OVERHEAD = Histogram(
    "slogate_overhead_seconds",
    "The gateway's own time before the response headers (the x-slogate-overhead-ms header): arrival to "
    "headers less receiving the body, the admission queue and waiting on engines",
    ["route"],
    buckets=_OVERHEAD_BUCKETS,
    registry=REGISTRY,
)
TOKENS = Counter(
    "slogate_tokens",
    "Tokens reported by upstream usage, by kind (prompt, completion, cached)",
    ["model", "kind"],
    registry=REGISTRY,
)
SSE_EVENTS = Counter("slogate_sse_events_relayed", "SSE events relayed to clients", registry=REGISTRY)
UPSTREAM_RETRIES = Counter(
    "slogate_upstream_retries",
    "Attempts that failed before the first byte in a way that allows another (connect, "
    "stale_connection, overloaded, cut, adapter_gone, engine_auth, stalled: its engine was found stalled "
    "before the answer began); another follows while attempts and engines remain",
    ["reason"],
    registry=REGISTRY,
)
UPSTREAM_ERRORS = Counter(
    "slogate_upstream_errors",
    "Upstream failures by engine and kind (connect, connect_timeout, protocol, status, stream_cut, timeout, "
    "stalled: a wait ended when the engine was found stalled, too_large: a whole answer past what the "
    "gateway holds)",
    ["engine", "kind"],
    registry=REGISTRY,
)
CLIENT_DISCONNECTS = Counter(
    "slogate_client_disconnects", "Clients that went away before the response ended", registry=REGISTRY
)
DISPATCHES = Counter(
    "slogate_dispatches", "Requests sent to an engine (retries count again)", ["engine"], registry=REGISTRY
)
PREFIX_ROUTED_TOKENS = Counter(
    "slogate_prefix_routed_tokens",
    "Prompt tokens of requests routed with a prefix index, by engine and whether the index held "
    "them on the engine chosen (hit) or not (miss): the prefill the routing expects to be skipped",
    ["engine", "result"],
    registry=REGISTRY,
)
PREFIX_ROUTED = Counter(
    "slogate_prefix_routed_requests",
    "Requests routed with a prefix index, by engine and by the most the index held of their prompt "
    "on the engine chosen: none, partial, full (every whole block)",
    ["engine", "match"],
    registry=REGISTRY,
)
AFFINITY_ROUTED = Counter(
    "slogate_affinity_routed_requests",
    "Requests with a session key, by whether they went to the session's last engine (kept), "
    "elsewhere (moved: load or the guard won) or had no known engine (new)",
    ["outcome"],
    registry=REGISTRY,
)
PREFIX_INDEX_BYTES = Gauge(
    "slogate_prefix_index_bytes", "Bytes the prefix index holds, by its own count", registry=REGISTRY
)
PREFIX_INDEX_BLOCKS = Gauge(
    "slogate_prefix_index_blocks",
    "Block keys the prefix index holds, by engine",
    ["engine"],
    registry=REGISTRY,
)
PREFIX_HASH = Histogram(
    "slogate_prefix_hash_seconds",
    "Front-door time to key a request's prompt for the prefix index (tokens and block hashes)",
    buckets=(*_FAST_BUCKETS, 0.05, 0.1),
    registry=REGISTRY,
)
PREFIX_KEYS_SKIPPED = Counter(
    "slogate_prefix_keys_skipped",
    "Requests routed without a prefix-index key (by load) because the engine tokenizer's keying "
    "threads already had a full queue, or the parse worker was keying another large body with one",
    registry=REGISTRY,
)
PD_REQUESTS = Counter(
    "slogate_pd_requests",
    "Requests of models served by prefill and decode engines, by path: disaggregated (prefill "
    "engine, then decode engine), collocated (whole on a collocated engine of the front pool), "
    "whole_on_prefill (embeddings in mode always), whole_on_decode (short prompt, n > 1, "
    "embeddings, or mode never), fallback (every prefill "
    "attempt failed: served whole on a decode engine), failed (refused, or failed before a prefill "
    "ended) or cancelled (the client left before a prefill ended)",
    ["model", "path"],
    registry=REGISTRY,
)
PD_DECODE_PLACEMENTS = Counter(
    "slogate_pd_decode_placements",
    "Decode-stage placements: feasible (TPOT and KV met), best_effort (none was), none (no decode "
    "engine in rotation)",
    ["outcome"],
    registry=REGISTRY,
)
MIGRATIONS = Counter(
    "slogate_migrations",
    "Streams resumed on another engine mid-answer (decode migration), by why they left their engine: "
    "failure (cut or ended early), stall (silent past the idle limit), slack (TPOT slack negative "
    "past the bound while another engine had room)",
    ["reason"],
    registry=REGISTRY,
)
MIGRATIONS_REFUSED = Counter(
    "slogate_migrations_refused",
    "Streams cut mid-answer that were ended with an error instead of migrated: unsupported (guided "
    "decoding, n > 1, log-probabilities, stop strings, images or audio in the prompt, an engine "
    "without token ids), limit "
    "(migration_limit reached), no_token_ids (nothing relayed to resume from), no_engine",
    ["why"],
    registry=REGISTRY,
)
NO_ENGINE = Counter(
    "slogate_no_engine",
    "Requests refused because no healthy engine serves the model",
    ["model"],
    registry=REGISTRY,
)
EVENT_LOOP_LAG = Histogram(
    "slogate_event_loop_lag_seconds",
    "How late a timer the gateway sets every quarter second runs: the longest the event loop was "
    "held by one piece of work (a dispatch call, a garbage collection, a parse) in that time; every "
    "stream the gateway relays stalls for as long",
    buckets=_PAUSE_BUCKETS,
    registry=REGISTRY,
)
GC_PAUSE = Histogram(
    "slogate_gc_pause_seconds",
    "Duration of each garbage collection of the gateway process, by generation (0, 1 young; 2 "
    "full): the loop and every stream are held while it runs",
    ["generation"],
    buckets=_PAUSE_BUCKETS,
    registry=REGISTRY,
)
DISPATCH_CALL = Histogram(
    "slogate_dispatch_call_seconds",
    "Wall time of the dispatch core's work per call from the live loop: submit (an arrival placed "
    "or queued) and step (a loop turn), by dispatcher",
    ["dispatcher", "call"],
    buckets=_FAST_BUCKETS,
    registry=REGISTRY,
)
POLICY_CALL = Histogram(
    "slogate_policy_call_seconds",
    "Wall time of each policy plugin call, recorded by the framework: filter:<name>, scorer:<name>, "
    "picker:<name> when the pipeline runs its plugins; ranked:<scorer> for a whole choice made from "
    "the fleet's ranked index (one scorer and max_score: no plugin is called)",
    ["plugin"],
    buckets=_FAST_BUCKETS,
    registry=REGISTRY,
)
REPLICAS = Gauge(
    "slogate_replicas",
    "Gateway replicas whose requests this one counts on the engines, itself included (1 without a "
    "shared state store, or while the store is out of reach past its time to live)",
    registry=REGISTRY,
)
STATE_STORE_ERRORS = Counter(
    "slogate_state_store_errors_total",
    "Exchanges with the state store that failed (a round of the replicas' load exchange, or a "
    "message of their routes): the store was out of reach or late",
    registry=REGISTRY,
)
REPLICA_ROUTES = Counter(
    "slogate_replica_routes_total",
    "Dispatches with a prompt or a session shared between gateway replicas: sent (told to the "
    "others), taken (another replica's, written into this one's prefix index and session map), "
    "skipped (another replica's, not all taken: an engine this one does not have, keys at "
    "another block size than this one's, or a session a later dispatch of which is known here), "
    "dropped (not sent: more "
    "waited than one message carries), rejected (messages, not routes: malformed or past the "
    "bounds, not taken at all; or a stored session malformed), recovered (sessions dispatched "
    "before this replica started, read from the store at its start), unwritten (sessions not "
    "written to the store for later replicas: new ones past its budget, affinity_max_sessions "
    "each affinity_ttl_s)",
    ["outcome"],
    registry=REGISTRY,
)
ENGINE_HEALTHY = Gauge(
    "slogate_engine_healthy", "1 when the engine is in rotation", ["engine"], registry=REGISTRY
)
ENGINE_EJECTED = Gauge(
    "slogate_engine_ejected",
    "1 while the engine is out of rotation after failed requests in a row (outlier ejection: "
    "outlier_consecutive_failures)",
    ["engine"],
    registry=REGISTRY,
)
ENGINE_EJECTIONS = Counter(
    "slogate_engine_ejections",
    "Outlier ejections: an engine taken out of rotation after failed requests in a row",
    ["engine"],
    registry=REGISTRY,
)
ENGINE_STALLED = Gauge(
    "slogate_engine_stalled",
    "1 while the engine is out of rotation for a stall: work held, no progress (stall_after_s)",
    ["engine"],
    registry=REGISTRY,
)
ENGINE_STALLS = Counter(
    "slogate_engine_stalls_total",
    "Times an engine was taken out of rotation for a stall",
    ["engine"],
    registry=REGISTRY,
)
ENGINE_IN_FLIGHT = Gauge(
    "slogate_engine_in_flight",
    "Requests this gateway has in flight on the engine",
    ["engine"],
    registry=REGISTRY,
)
ENGINE_WAITING = Gauge(
    "slogate_engine_waiting", "Engine-reported waiting requests", ["engine"], registry=REGISTRY
)
ENGINE_RUNNING = Gauge(
    "slogate_engine_running", "Engine-reported running requests", ["engine"], registry=REGISTRY
)
ENGINE_KV_USAGE = Gauge(
    "slogate_engine_kv_usage", "Engine-reported KV cache usage 0..1", ["engine"], registry=REGISTRY
)

# -- queueing, shedding and SLOs (per SLO class) ----------------------------------------------------
QUEUE_DEPTH = Gauge(
    "slogate_queue_depth", "Requests waiting in the admission queue", ["slo_class"], registry=REGISTRY
)
QUEUE_WAIT = Histogram(
    "slogate_queue_wait_seconds",
    "Time from arrival to dispatch (or shed) in the admission queue",
    ["slo_class"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
SHEDS = Counter(
    "slogate_sheds",
    "Requests refused by the gateway, by class and reason (queue_full, infeasible, timeout, no_engine, "
    "shutdown, saturated: the pool was saturated and the routing profile sheds; gateway_resources: "
    "the gateway had no socket to open for the engine)",
    ["slo_class", "reason"],
    registry=REGISTRY,
)
SLO_REQUESTS = Counter(
    "slogate_slo_requests",
    "Every classified request once, by SLO class and outcome: met, missed_ttft, missed_tpot, "
    "missed_latency (non-streamed: end-to-end over TTFT + TPOT x (tokens - 1)), rejected (shed or "
    "no engine), error (gateway or engine failure), cancelled (client left). Client mistakes "
    "(4xx other than 429) are not counted",
    ["slo_class", "outcome"],
    registry=REGISTRY,
)
SLO_OUTCOMES = Counter(
    "slogate_slo_outcomes",
    "Served streamed requests by SLO class, objective (ttft, tpot, both) and outcome (met, missed)",
    ["slo_class", "objective", "outcome"],
    registry=REGISTRY,
)
PARSE_WORKER_FAILURES = Counter(
    "slogate_parse_worker_failures",
    "Large request bodies whose worker process died while parsing them (parsed in place instead)",
    registry=REGISTRY,
)
BODY_BYTES = Gauge(
    "slogate_request_body_bytes",
    "Bytes of request bodies the gateway holds now (received, of requests not yet ended)",
    registry=REGISTRY,
)
BODY_BUDGET_REFUSALS = Counter(
    "slogate_body_budget_refusals",
    "Requests refused with a 503 because the bodies held at once would pass max_body_memory_bytes",
    registry=REGISTRY,
)
SLOW_CLIENTS = Counter(
    "slogate_slow_clients",
    "Streams ended because the client stopped reading for longer than the idle limit",
    registry=REGISTRY,
)
LATENCY_COEFF = Gauge(
    "slogate_latency_coefficient",
    "Fitted latency model coefficients (HyperFlexis eq. 1 prefill a,b,c; eq. 2 decode a',b',c')",
    ["engine", "stage", "name"],
    registry=REGISTRY,
)
LATENCY_ERROR = Gauge(
    "slogate_latency_prediction_error",
    "Mean relative error of the fitted latency model on recent samples",
    ["engine", "stage"],
    registry=REGISTRY,
)
LATENCY_SAMPLES = Counter(
    "slogate_latency_samples",
    "Latency-model samples by engine and stage (prefill, decode): kept for the fit (outcome kept, or "
    "calibration for probes), refuted by the engine's own counters for their scrape interval, or "
    "unclean (an engine step that measured neither equation cleanly; stage step)",
    ["engine", "stage", "outcome"],
    registry=REGISTRY,
)
CALIBRATION_PROBES = Counter(
    "slogate_calibration_probes",
    "Calibration requests the gateway sent to an engine of its own accord (never client traffic), by "
    "outcome: ok, failed, or interrupted (client work arrived, the probe's timing was not used)",
    ["engine", "outcome"],
    registry=REGISTRY,
)


# -- the reference table in docs/observability.md ---------------------------------------------------

_SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exported() -> list[Any]:
    """Every metric object registered in :data:`REGISTRY`, by name."""
    # prometheus_client keeps no public list of a registry's collectors with their label names
    collectors = REGISTRY._collector_to_names
    return sorted(collectors, key=lambda m: m._name)


def series_names() -> dict[str, tuple[str, ...]]:
    """Each series name a scrape can hold (``_total``, ``_bucket``...) -> that metric's label names."""
    out: dict[str, tuple[str, ...]] = {}
    for metric in _exported():
        for suffix in _SERIES_SUFFIXES[metric._type]:
            out[metric._name + suffix] = tuple(metric._labelnames)
    return out


def reference_table() -> str:
    """The Markdown table of every metric, as docs/observability.md holds it (a test compares)."""
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for metric in _exported():
        name = metric._name + ("_total" if metric._type == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in metric._labelnames) or "-"
        # help texts are plain text: nothing in them may turn into Markdown or HTML
        text = metric._documentation.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        lines.append(f"| `{name}` | {metric._type} | {labels} | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m gateway.metrics > table.md: regenerate the docs table
    print(reference_table(), end="")
