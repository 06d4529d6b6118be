"""A bound on the request bodies the gateway holds at once.

``max_body_bytes`` bounds one body; nothing bounded how many arrive at once, so a few hundred
clients each uploading a 16 MB prompt (slowly, within ``body_timeout_s``) took gigabytes and the
gateway's process with them. Every body's bytes are counted as they arrive until its request ends,
and past ``max_body_memory_bytes`` a body gets a 503 with Retry-After (one whose declared length
would not fit, before any of it is read). Large bodies may fill only three quarters of the
budget: the rest stays for ordinary requests (bodies up to ``SMALL_BODY_BYTES``), which a flood of
uploads must not starve.
"""

from __future__ import annotations

from gateway import metrics
from gateway.api.errors import GatewayError

#: a body no larger than this may use the whole budget; larger ones only its large share
SMALL_BODY_BYTES = 64 * 1024


def large_share(limit: int) -> int:
    """What bodies larger than ``SMALL_BODY_BYTES`` may hold of a budget of ``limit`` bytes."""
    return limit - limit // 4


class BodyBudget:
    """The bytes of request bodies held now, against ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.large_limit = large_share(limit)
        self.held = 0

    def lease(self) -> BodyLease:
        return BodyLease(self)


class BodyLease:
    """One request's share of the budget: taken as its body arrives, given back whole by
    :meth:`release` when the request ends (whatever ended it)."""

    __slots__ = ("budget", "taken")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.taken = 0

    def admit(self, size: int) -> None:
        """Raise the 503 unless a body of ``size`` bytes in all would fit now. Nothing is held:
        a declared length is checked up front (a body that could not be held is not waited
        for), but only bytes that arrive are held (a head declaring 16 MB and sending nothing
        must not take 16 MB of the budget for ``body_timeout_s``)."""
        budget = self.budget
        cap = budget.limit if size <= SMALL_BODY_BYTES else budget.large_limit
        if budget.held + size - self.taken > cap:
            metrics.BODY_BUDGET_REFUSALS.inc()
            # (the connection stays open: the server's protocol drops what is left of this body)
            raise GatewayError(
                503,
                "the gateway holds as many request bodies as it may at once; retry later",
                code="server_busy",
                retry_after_s=1.0,
            )

    def take_up_to(self, size: int) -> None:
        """Hold ``size`` bytes for this body in all (what it holds already included); raises the
        503 when the budget has no room for them."""
        if size <= self.taken:
            return
        self.admit(size)
        self.budget.held += size - self.taken
        self.taken = size
        metrics.BODY_BYTES.set(self.budget.held)

    def release(self) -> None:
        if self.taken:
            self.budget.held -= self.taken
            self.taken = 0
            metrics.BODY_BYTES.set(self.budget.held)
