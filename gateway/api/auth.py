"""Who is calling and what they may claim: API keys, admin keys and per-key SLO ceilings.

Two kinds of key. Client keys (``api_keys`` plus every key in ``api_key_policies``) open the
OpenAI routes; admin keys (``admin_api_keys``) open ``/admin/*`` and, unless ``metrics_public``
(``dashboard_public``), ``/metrics`` (``/dashboard``). Neither kind opens the other's routes (a
known key on the wrong route gets 403, anything else 401). With no client keys the OpenAI routes
are open; with no key of either kind everything is open, as before keys existed.

Keys are looked up by their SHA-256 digest and confirmed with :func:`hmac.compare_digest`, so
the time a lookup takes says nothing about how much of a guess was right. Only fingerprints
(:func:`key_fingerprint`) ever leave this module.

The clamp functions are pure: they take what a client claimed and the key's
:class:`ApiKeyPolicy` and return what the gateway will honour.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from gateway.api.errors import GatewayError
from gateway.settings import ApiKeyPolicy, Settings, key_fingerprint
from policies.slo import SloHints, SloSource, SloTarget

__all__ = [
    "OPEN_POLICY",
    "ApiKeyPolicy",
    "AuthError",
    "Authenticator",
    "Identity",
    "basic_password",
    "bearer_token",
    "clamp_hints",
    "clamp_target",
    "forwardable_headers",
    "key_fingerprint",
    "redact_headers",
]

Role = Literal["anonymous", "client", "admin"]

#: the policy of a caller without a (known) key, or with a key that has no policy: its claims
#: stand as made, its routing decisions are shown when it asks
OPEN_POLICY = ApiKeyPolicy(task_override=True, decisions=True)

_AUTHORIZATION = b"authorization"
_BEARER = b"bearer"
_BASIC = b"basic"
_BASIC_CHALLENGE = b'Basic realm="slogate dashboard", charset="UTF-8"'
#: request headers whose values are credentials (never logged)
_SECRET_HEADERS = frozenset({b"authorization", b"proxy-authorization", b"x-api-key", b"cookie"})
#: client headers the proxy relays upstream: W3C trace context, and the simulated engine's
#: controls (which each adapter then keeps or drops, see EngineAdapter.forwarded_headers)
_FORWARDED_PREFIXES = (b"x-sim-", b"traceparent", b"tracestate")
_HEADER_NAME = re.compile(rb"[a-z0-9-]{1,64}")
_HEADER_VALUE = re.compile(rb"[\x20-\x7e]{0,1024}")


@dataclass(frozen=True, slots=True)
class Identity:
    """The caller as authentication found it. ``key_id`` is a fingerprint, never the key."""

    role: Role
    key_id: str | None
    policy: ApiKeyPolicy

    @property
    def tenant(self) -> str | None:
        return self.policy.tenant

    @property
    def task(self) -> str | None:
        return self.policy.task


ANONYMOUS = Identity("anonymous", None, OPEN_POLICY)


class AuthError(GatewayError):
    """401 (no or unknown key) or 403 (a known key on a route its kind does not open).

    ``extra_headers`` must go out with the error: a 401 carries ``WWW-Authenticate`` (RFC 6750).
    """

    def __init__(self, status: Literal[401, 403], message: str, *, invalid_token: bool = False) -> None:
        super().__init__(status, message, code="invalid_api_key" if status == 401 else "permission_denied")
        challenge = b'Bearer realm="slogate"' + (b', error="invalid_token"' if invalid_token else b"")
        self.extra_headers = ((b"www-authenticate", challenge),) if status == 401 else ()


def bearer_token(value: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` value, or None.

    The scheme is case-insensitive (RFC 7235) and surrounding whitespace is tolerated. Any bytes
    are accepted without raising: a garbage header is simply not a key.
    """
    if not value:
        return None
    parts = value.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != _BEARER:
        return None
    token = parts[1].strip()
    return token or None


def basic_password(value: bytes | None) -> bytes | None:
    """The password of an ``Authorization: Basic <base64(user:password)>`` value, or None.

    Like :func:`bearer_token`, garbage is simply not a key: this never raises.
    """
    if not value:
        return None
    parts = value.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != _BASIC:
        return None
    try:
        decoded = base64.b64decode(parts[1].strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _, sep, password = decoded.partition(b":")
    return password if sep and password else None


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    kind: Literal["client", "admin", "label"]
    key_id: str
    policy: ApiKeyPolicy


class Authenticator:
    """Built once from settings; :meth:`identify` and the route checks are then lock-free reads."""

    def __init__(self, settings: Settings) -> None:
        policies = settings.key_policies()
        clients = settings.client_keys()
        entries: dict[bytes, _Entry] = {}
        # "label" keys are only in api_key_tasks/api_key_tenants: they name a task or tenant but
        # are accepted only when the OpenAI routes are open (as before policies existed).
        for key in {*clients, *policies}:
            kind: Literal["client", "label"] = "client" if key in clients else "label"
            digest = _digest(key.encode())
            entries[digest] = _Entry(digest, kind, key_fingerprint(key), policies.get(key, OPEN_POLICY))
        for key in settings.admin_api_keys:
            digest = _digest(key.encode())
            entries[digest] = _Entry(digest, "admin", key_fingerprint(key), OPEN_POLICY)
        self._entries = entries
        #: the OpenAI routes need a client key
        self.client_auth = bool(clients)
        #: /admin/* needs an admin key (whenever any key is configured, so that turning on client
        #: keys never leaves the fleet's internals open)
        self.admin_auth = bool(clients or settings.admin_api_keys)
        self.metrics_auth = self.admin_auth and not settings.metrics_public
        self.dashboard_auth = self.admin_auth and not settings.dashboard_public

    def _lookup(self, headers: Mapping[bytes, bytes]) -> _Entry | None:
        token = bearer_token(headers.get(_AUTHORIZATION))
        if token is None:
            return None
        digest = _digest(token)
        # The dict probe compares digests, not keys: its timing reveals at most how much of the
        # guess's SHA-256 matched a key's, which does not help find a key. compare_digest then
        # confirms the hit in constant time.
        entry = self._entries.get(digest)
        if entry is None or not hmac.compare_digest(entry.digest, digest):
            return None
        return entry

    def identify(self, headers: Mapping[bytes, bytes]) -> Identity:
        """Whose key the request carries, without enforcing anything; never raises."""
        entry = self._lookup(headers)
        if entry is None:
            return ANONYMOUS
        role: Role = "admin" if entry.kind == "admin" else "client"
        return Identity(role, entry.key_id, entry.policy)

    def client(self, headers: Mapping[bytes, bytes]) -> Identity:
        """The caller of an OpenAI route, or :class:`AuthError` (401 / 403 for an admin key)."""
        entry = self._lookup(headers)
        if entry is not None and entry.kind == "admin":
            if not self.client_auth:
                return ANONYMOUS  # open routes: an admin key is just no key
            raise AuthError(403, "admin keys cannot call the OpenAI routes; use a client key")
        if entry is not None and (entry.kind == "client" or not self.client_auth):
            return Identity("client", entry.key_id, entry.policy)
        if self.client_auth:
            raise self._unauthorized(headers)
        return ANONYMOUS

    def admin(self, headers: Mapping[bytes, bytes]) -> Identity:
        """The caller of an admin route, or :class:`AuthError` (401 / 403 for a client key)."""
        if not self.admin_auth:
            return self.identify(headers)
        entry = self._lookup(headers)
        if entry is not None and entry.kind == "admin":
            return Identity("admin", entry.key_id, entry.policy)
        if entry is not None and (entry.kind == "client" or (entry.kind == "label" and not self.client_auth)):
            raise AuthError(403, "this route needs an admin key; client keys are not admin keys")
        raise self._unauthorized(headers)

    def metrics(self, headers: Mapping[bytes, bytes]) -> Identity:
        """The caller of ``/metrics``: open when ``metrics_public``, else as :meth:`admin`."""
        return self.admin(headers) if self.metrics_auth else self.identify(headers)

    def dashboard(self, headers: Mapping[bytes, bytes]) -> Identity:
        """The caller of ``/dashboard``: open when ``dashboard_public``, else as :meth:`admin`.

        A browser cannot add a Bearer header to a page it navigates to, so the admin key is also
        accepted as the password of HTTP Basic auth (any user name), and a 401 asks for it: the
        browser prompts once and sends it with the page's own requests too.
        """
        if not self.dashboard_auth:
            return self.identify(headers)
        password = basic_password(headers.get(_AUTHORIZATION))
        if password is not None:
            headers = {_AUTHORIZATION: b"Bearer " + password}
        try:
            return self.admin(headers)
        except AuthError as error:
            if error.status == 401:
                error.extra_headers = ((b"www-authenticate", _BASIC_CHALLENGE), *error.extra_headers)
            raise

    def dashboard_in_full(self, headers: Mapping[bytes, bytes]) -> bool:
        """Whether a caller of ``/dashboard`` sees clients' request ids and engines' errors: with
        no keys set, anyone; else an admin key (Bearer or Basic), which ``dashboard_public`` does
        not ask for: its public view is what ``/metrics`` shows."""
        if not self.admin_auth:
            return True
        password = basic_password(headers.get(_AUTHORIZATION))
        if password is not None:
            headers = {_AUTHORIZATION: b"Bearer " + password}
        entry = self._lookup(headers)
        return entry is not None and entry.kind == "admin"

    @staticmethod
    def _unauthorized(headers: Mapping[bytes, bytes]) -> AuthError:
        if headers.get(_AUTHORIZATION) is None:
            return AuthError(401, "missing API key: send 'Authorization: Bearer <key>'")
        return AuthError(401, "invalid API key", invalid_token=True)


# -- SLO ceilings (pure) ---------------------------------------------------------------------------


def clamp_hints(hints: SloHints, policy: ApiKeyPolicy) -> SloHints:
    """What the gateway honours of ``hints`` under ``policy``; every rule only ever loosens.

    * priority: lower is more urgent (0 highest), so a claim below ``max_priority`` is raised
      to it; no claim stays no claim;
    * explicit TTFT/TPOT below the key's minimum are raised to the minimum;
    * task: the key's task, unless ``task_override`` and the client named one; a key without a
      task leaves the client's;
    * tenant: the key's (a client cannot name its own).
    """
    priority = hints.priority
    if priority is not None and policy.max_priority is not None:
        priority = max(priority, policy.max_priority)
    ttft = hints.ttft_ms
    if ttft is not None and policy.min_ttft_ms is not None:
        ttft = max(ttft, policy.min_ttft_ms)
    tpot = hints.tpot_ms
    if tpot is not None and policy.min_tpot_ms is not None:
        tpot = max(tpot, policy.min_tpot_ms)
    task = hints.task
    if policy.task is not None and not (policy.task_override and task):
        task = policy.task
    return SloHints(ttft_ms=ttft, tpot_ms=tpot, task=task, priority=priority, tenant=policy.tenant)


#: the rules whose targets a client chooses (headers, a task it names, or claiming nothing)
CLIENT_SOURCES = frozenset({SloSource.EXPLICIT, SloSource.TASK, SloSource.DEFAULT})


def clamp_target(
    target: SloTarget,
    policy: ApiKeyPolicy,
    level_floor: tuple[float, float] | None = None,
    client_sources: frozenset[SloSource] = CLIENT_SOURCES,
) -> SloTarget:
    """``target`` no tighter than the key's minimums, whichever rule produced it.

    Clamping the explicit headers is not enough: a task the client may pick, or the priority
    mapper's relaxed floor, can also promise more than the key is allowed. ``level_floor``: the
    TTFT and TPOT floors of the key's ``max_priority`` level, when the profile has levels. They
    bind the targets of the rules in ``client_sources``, the ones the client chose: a key held
    to priority 3 got the default class's 1.5 s by claiming nothing, 0.7 s by naming a task and
    1 ms by asking, where its level promises 15 s. What the operator chose (the key's own task, a
    tenant's class) stands, and so do the mapper's targets for the key's level (Algorithm 2's
    relaxed floor included), as for any client of that level.
    """
    ttft_s, tpot_s = target.ttft_s, target.tpot_s
    if policy.min_ttft_ms is not None:
        ttft_s = max(ttft_s, policy.min_ttft_ms / 1000)
    if policy.min_tpot_ms is not None:
        tpot_s = max(tpot_s, policy.min_tpot_ms / 1000)
    if level_floor is not None:
        if target.source in client_sources:
            ttft_s = max(ttft_s, level_floor[0])
        if (target.tpot_source or target.source) in client_sources:
            tpot_s = max(tpot_s, level_floor[1])
    if (ttft_s, tpot_s) == (target.ttft_s, target.tpot_s):
        return target
    return dataclasses.replace(target, ttft_s=ttft_s, tpot_s=tpot_s)


# -- headers that leave the gateway --------------------------------------------------------------


def forwardable_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The client headers the proxy may relay upstream (trace context, ``x-sim-*``), as text.

    Only token names and visible-ASCII values are kept: they are copied into upstream requests,
    and anything else could not be valid trace context or a sim control. The adapter then drops
    what its engine must not see.
    """
    return {
        k.decode(): v.decode()
        for k, v in raw
        if k.startswith(_FORWARDED_PREFIXES) and _HEADER_NAME.fullmatch(k) and _HEADER_VALUE.fullmatch(v)
    }


def redact_headers(headers: Mapping[bytes, bytes] | Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """Headers fit for a log line or a span: credential values replaced by ``<redacted>``."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    return {
        k.decode("latin-1"): "<redacted>" if k.lower() in _SECRET_HEADERS else v.decode("latin-1")
        for k, v in items
    }
