"""The simulated engine's model: continuous batching over a paged KV cache. Pure and clock-injected.

A driver calls :meth:`EngineModel.plan` to form the next batch at simulated time ``now`` (it gets
the batch and its duration from HyperFlexis eq.(1)/(2)), waits that long (really, or virtually),
then calls :meth:`EngineModel.finish` to apply it. ``finish`` returns the tokens each request
produced and which requests ended. Nothing here sleeps, reads a clock or does I/O, so the
real-time HTTP server and an offline cluster simulator share this exact model.

Scheduling follows vLLM's V1 scheduler in outline: running requests first (one decode token
each, or their next prefill chunk), then waiting requests in FCFS or priority order while there
are sequence slots, token budget and KV blocks. A running request that needs a block when none
is free preempts the lowest-priority, latest-arrived running request (recompute: its blocks are
released and it goes back to the front of the waiting queue).

P/D: a decode engine's KV arrives over its ingress link, modelled as one serial FIFO channel:
:meth:`EngineModel.reserve_link` starts a transfer when the link is free (at once, or when the
transfers reserved before it end) and keeps the link for the profile's transfer time (setup
latency plus size over bandwidth), so concurrent transfers into one engine queue behind each other
and the order they are handed to the link decides who waits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from gateway.sim.kv_cache import KVCache, SeqBlocks, prefix_hashes
from gateway.sim.output import TokenStream, choice_state, sequence_state
from gateway.sim.profiles import EngineProfile
from gateway.sim.stats import EngineStats
from policies.latency import batch_step_time


class Phase(Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"  # decode engine pulling KV from a prefill engine
    RUNNING = "running"
    HELD = "held"  # prefill engine keeping KV for a decode engine to read
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the engine. ``arrival``/``*_at`` are simulated seconds.

    Compared by identity: the engine finds a request in its queues with ``in`` and ``remove``,
    and two requests with the same fields are still two requests."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    priority: int = 0
    ignore_eos: bool = False
    #: workload-set natural length (``sim_output_len``): the model "emits EOS" after this many
    #: tokens (finish_reason "stop") and never earlier; None = EOS comes from the output function
    output_len: int | None = None
    #: prefill only: compute the prompt, emit one token, then hold the KV for a decode engine
    prefill_only: bool = False
    #: KV arrives from elsewhere (P/D): no prefill compute; ready at ``kv_ready_at``
    remote_kv: bool = False
    kv_ready_at: float = 0.0
    #: stop making progress (fault injection)
    stuck: bool = False
    #: embeddings: prefill the prompt, produce no token, finish with reason "stop"
    pooling: bool = False
    #: which of a request's ``n`` choices this is; choice i > 0 draws from its own output function
    choice: int = 0
    #: the prompt's rolling state under the engine's seed (:func:`sequence_state`), when the
    #: caller computed it once for the n choices sharing the prompt; None: computed on admission
    prompt_state: int | None = None
    phase: Phase = Phase.WAITING
    computed: int = 0  # tokens of prompt + output whose KV exists
    cached_tokens: int = 0
    output: list[int] = field(default_factory=list)
    seq: SeqBlocks = field(default_factory=SeqBlocks)
    stream: TokenStream | None = None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    order: int = 0

    @property
    def length(self) -> int:
        """Tokens in context: prompt plus everything generated so far."""
        return len(self.prompt) + len(self.output)

    @property
    def pending(self) -> int:
        """Tokens whose KV still has to be computed; 1 while decoding (the last sampled token)."""
        return self.length - self.computed

    @property
    def prefilling(self) -> bool:
        return not self.output or self.pending > 1

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True, slots=True)
class Batch:
    """What one engine step runs: prefill chunks (request, tokens) and decode requests."""

    prefills: tuple[tuple[SimRequest, int], ...]
    decodes: tuple[SimRequest, ...]
    duration: float


@dataclass(slots=True)
class StepResult:
    tokens: list[tuple[SimRequest, int]] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)


@dataclass(slots=True)
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class EngineModel:
    def __init__(
        self,
        profile: EngineProfile,
        *,
        priority_scheduling: bool = False,
        slow_factor: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.profile = profile
        self.seed = seed
        self.cache = KVCache(profile.num_gpu_blocks, profile.block_size)
        self.priority_scheduling = priority_scheduling
        self.slow_factor = slow_factor
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.transferring: list[SimRequest] = []
        self.held: dict[str, SimRequest] = {}
        self.requests: dict[str, SimRequest] = {}
        self.counters = Counters()
        #: vLLM's per-step and per-finished-request statistics (exported as its histograms)
        self.stats = EngineStats(profile.max_model_len)
        self.coefficients = profile.latency.coefficients
        self.paused = False  # asleep or loading weights: nothing is scheduled
        self.admitting = True  # False while draining for /sleep?mode=wait: running ones finish
        self._order = 0
        #: the ingress KV link (serial FIFO): when it finishes the transfers reserved so far
        self.link_free_at = 0.0
        #: transfers reserved and link seconds they took, since start
        self.link_transfers = 0
        self.link_busy_s = 0.0

    # -- admission -------------------------------------------------------------------------------

    def add(self, request: SimRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self._order += 1
        request.order = self._order
        if request.stream is None:
            ignore_eos = request.ignore_eos or request.output_len is not None
            prompt_state = request.prompt_state
            if prompt_state is None:
                prompt_state = sequence_state(request.prompt, self.seed)
            request.stream = TokenStream((), ignore_eos, state=choice_state(prompt_state, request.choice))
        self.requests[request.request_id] = request
        (self.transferring if request.remote_kv else self.waiting).append(request)

    def abort(self, request_id: str) -> SimRequest | None:
        """Remove a request wherever it is and free its blocks (client went away)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            request = self.held.pop(request_id, None)
            if request is not None:
                self.cache.release(request.seq)
            return request
        for queue in (self.waiting, self.running, self.transferring):
            if request in queue:
                queue.remove(request)
        self.held.pop(request_id, None)
        self.cache.release(request.seq)
        request.phase = Phase.FINISHED
        request.finish_reason = request.finish_reason or "abort"
        return request

    def release_held(self, request_id: str) -> SimRequest | None:
        """A decode engine read (or gave up on) the KV a prefill left here."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.cache.release(request.seq)
        return request

    def expire_held(self, now: float, lease_s: float) -> list[str]:
        expired = [
            rid
            for rid, r in self.held.items()
            if r.first_token_at is not None and now - r.first_token_at > lease_s
        ]
        for rid in expired:
            self.release_held(rid)
        return expired

    def reserve_link(self, tokens: int, now: float) -> float:
        """Reserve the ingress link for ``tokens`` of KV from ``now``; returns when they have all
        arrived. The link carries one transfer at a time, in the order they are reserved."""
        start = max(now, self.link_free_at)
        seconds = self.profile.transfer_time_s(tokens)
        self.link_free_at = start + seconds
        self.link_transfers += 1
        self.link_busy_s += seconds
        return self.link_free_at

    # -- scheduling ------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.transferring)

    def next_transfer_at(self) -> float:
        return min((r.kv_ready_at for r in self.transferring), default=math.inf)

    def _waiting_order(self) -> list[SimRequest]:
        if self.priority_scheduling:
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival, r.order))
        return self.waiting

    def _preempt_one(self, protect: SimRequest) -> SimRequest | None:
        """Preempt the running request vLLM would (lowest priority, then latest arrival)."""
        victims = [r for r in self.running if r is not protect]
        if not victims:
            return None
        victim = max(victims, key=lambda r: (r.priority, r.arrival, r.order))
        self._preempt(victim)
        return victim

    def _preempt(self, victim: SimRequest) -> None:
        # recompute, not swap: blocks go back to the pool and it re-prefills prompt + output later
        self.running.remove(victim)
        self.cache.release(victim.seq)
        victim.computed = 0
        victim.phase = Phase.WAITING
        self.counters.preemptions += 1
        self.waiting.insert(0, victim)

    def _admit_transfers(self, now: float) -> None:
        for request in [r for r in self.transferring if r.kv_ready_at <= now]:
            if len(self.running) >= self.profile.max_num_seqs:
                break
            if not self.cache.allocate(request.seq, self.cache.blocks_needed(len(request.prompt) + 1)):
                break
            self.transferring.remove(request)
            request.computed = len(request.prompt) - 1  # the last prompt token yields the first output
            request.phase = Phase.RUNNING
            request.scheduled_at = now
            self.cache.commit_full_blocks(request.seq, request.prompt, request.computed)
            self.running.append(request)

    def plan(self, now: float) -> Batch | None:
        """The next batch at ``now`` (simulated s), or None when nothing can run.

        Called by the driver before each step; the returned batch must be passed to
        :meth:`finish` at ``now + batch.duration`` (or dropped if the engine died meanwhile).
        """
        if self.paused:
            return None
        self._admit_transfers(now)
        budget = self.profile.max_num_batched_tokens
        prefills: list[tuple[SimRequest, int]] = []
        decodes: list[SimRequest] = []
        for request in list(self.running):
            if request.phase is not Phase.RUNNING or request.stuck or budget <= 0:
                continue  # preempted earlier in this loop, or a fault holds it
            if request.prefilling:
                chunk = min(request.pending, budget)
                prefills.append((request, chunk))
                budget -= chunk
                continue
            # the sampled token needs a KV slot: allocate at a block boundary, preempting if full
            need = self.cache.blocks_needed(request.length + 1) - len(request.seq.blocks)
            fits = need <= 0 or self.cache.allocate(request.seq, need)
            while not fits:
                victim = self._preempt_one(request)
                if victim is None:
                    self._preempt(request)  # alone and still no room: it waits for space itself
                    break
                if victim in decodes:
                    decodes.remove(victim)
                    budget += 1
                for entry in [p for p in prefills if p[0] is victim]:
                    prefills.remove(entry)
                    budget += entry[1]
                fits = self.cache.allocate(request.seq, need)
            if fits:
                decodes.append(request)
                budget -= 1
        for request in list(self._waiting_order()) if self.admitting else ():
            if budget <= 0 or len(self.running) >= self.profile.max_num_seqs:
                break
            if request.stuck:
                continue
            started = self._start(request, now, budget)
            if started is None:
                break  # head-of-line: no KV space; keep order like vLLM
            prefills.append((request, started))
            budget -= started
        if not prefills and not decodes:
            return None
        return Batch(tuple(prefills), tuple(decodes), self._duration(prefills, decodes))

    def _start(self, request: SimRequest, now: float, budget: int) -> int | None:
        """Move a waiting request to running: reuse cached prefix blocks, allocate the rest.

        A preempted request comes back with its output so far and recomputes all of it.
        """
        bs = self.profile.block_size
        tokens = request.all_tokens()
        hashes = prefix_hashes(tokens, bs)
        hits = self.cache.cached_prefix_blocks(hashes)
        if hits * bs >= len(tokens):
            hits -= 1  # at least one token must be computed to produce logits, as in vLLM
        total_blocks = self.cache.blocks_needed(len(tokens) + 1)
        if total_blocks - hits > self.cache.available:
            return None
        uncached = len(tokens) - hits * bs
        if (
            not self.profile.chunked_prefill
            and uncached > budget
            and (self.running or self.waiting[0] is not request)
        ):
            return None
        self.waiting.remove(request)
        request.computed = self.cache.acquire_prefix(request.seq, hashes[:hits])
        self.cache.allocate(request.seq, total_blocks - hits)
        if request.scheduled_at is None:
            request.cached_tokens = request.computed
            self.counters.prefix_queries += len(request.prompt)
            self.counters.prefix_hits += request.computed
            request.scheduled_at = now
        request.phase = Phase.RUNNING
        self.running.append(request)
        return uncached if not self.profile.chunked_prefill else min(uncached, budget)

    def _duration(self, prefills: Iterable[tuple[SimRequest, int]], decodes: list[SimRequest]) -> float:
        """Simulated seconds of one step: one forward pass over the chunks and decodes."""
        chunks = [n for _, n in prefills]
        seconds = batch_step_time(self.coefficients, chunks, [r.length for r in decodes])
        return seconds * self.slow_factor

    # -- applying a step -------------------------------------------------------------------------

    def finish(self, batch: Batch, now: float) -> StepResult:
        """Apply ``batch`` (planned earlier) at ``now``, its end time."""
        result = StepResult()
        first_prompts = 0
        for request, chunk in batch.prefills:
            if request.phase is not Phase.RUNNING:
                continue  # aborted or preempted meanwhile
            request.computed = min(request.length, request.computed + chunk)
            self.cache.commit_full_blocks(request.seq, request.all_tokens(), request.computed)
            if request.computed >= request.length:
                if not request.output:
                    self.counters.prompt_tokens += len(request.prompt)
                    if not request.pooling:
                        first_prompts += len(request.prompt)
                if request.pooling:
                    # the pooled hidden state is the whole answer: no token, no decode step
                    self.complete(request, "stop")
                    result.finished.append(request)
                    continue
                self._emit(request, now, result)
        for request in batch.decodes:
            if request.phase is Phase.RUNNING:
                request.computed += 1
                self._emit(request, now, result)
        if result.tokens:
            self.stats.step(first_prompts, len(result.tokens))
        return result

    def _emit(self, request: SimRequest, now: float, result: StepResult) -> None:
        assert request.stream is not None
        token = request.stream.next_token()
        request.output.append(token)
        if request.first_token_at is None:
            request.first_token_at = now
        request.last_token_at = now
        self.counters.generation_tokens += 1
        result.tokens.append((request, token))
        if request.computed % self.profile.block_size == 0:
            self.cache.commit_full_blocks(request.seq, request.all_tokens(), request.computed)
        produced = len(request.output)
        reason = None
        if request.output_len is not None:
            if produced >= request.output_len:
                reason = "stop"  # the workload-set natural end stands in for a sampled EOS
        elif token == request.stream.eos_id and not request.ignore_eos:
            reason = "stop"
        if reason is None and (produced >= request.max_tokens or request.prefill_only):
            reason = "length"
        if reason is not None:
            self.complete(request, reason)
            result.finished.append(request)

    def complete(self, request: SimRequest, reason: str) -> None:
        """End a request (also used by the server when a stop string matches)."""
        if request.phase is Phase.FINISHED or request.phase is Phase.HELD:
            if reason == "stop" and request.finish_reason == "length":
                # the server matched a stop string in the last token the limit allowed: vLLM's
                # detokenizer reports that as a stop, and so is it counted
                self.counters.finished["length"] -= 1
                self.counters.finished["stop"] = self.counters.finished.get("stop", 0) + 1
                request.finish_reason = "stop"
            return
        request.finish_reason = reason
        # (a stop string can end a request that was preempted meanwhile: then it waits to be
        # recomputed, and left in the queue it ran again with no one to read it)
        for queue in (self.running, self.waiting, self.transferring):
            if request in queue:
                queue.remove(request)
        self.requests.pop(request.request_id, None)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        if (
            request.scheduled_at is not None
            and request.first_token_at is not None
            and request.last_token_at is not None
        ):
            self.stats.finished(
                arrival=request.arrival,
                scheduled=request.scheduled_at,
                first_token=request.first_token_at,
                last_token=request.last_token_at,
                prompt_tokens=len(request.prompt),
                cached_tokens=request.cached_tokens,
                generated=len(request.output),
                max_tokens=request.max_tokens,
            )
        if request.prefill_only:
            request.phase = Phase.HELD
            self.held[request.request_id] = request
        else:
            request.phase = Phase.FINISHED
            self.cache.release(request.seq)

    def preempt_all(self) -> None:
        """Send every running request back to waiting (its KV is being discarded; it recomputes)."""
        for request in list(self.running):
            self._preempt(request)

    def reset(self) -> list[SimRequest]:
        """Drop every request (crash, or sleep that discards the KV cache); returns what was lost."""
        lost = [*self.waiting, *self.running, *self.transferring]
        for request in lost:
            request.phase = Phase.FINISHED
            request.finish_reason = "abort"
            self.cache.release(request.seq)
        for request in self.held.values():
            self.cache.release(request.seq)
        self.waiting.clear()
        self.running.clear()
        self.transferring.clear()
        self.held.clear()
        self.requests.clear()
        self.cache.clear()
        self.link_free_at = 0.0  # transfers in progress are lost with the engine
        return lost
