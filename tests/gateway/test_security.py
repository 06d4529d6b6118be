"""API keys, admin keys, per-key SLO ceilings, forwarded headers, and keys never leaking."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import aiohttp
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.api.auth import (
    ANONYMOUS,
    ApiKeyPolicy,
    Authenticator,
    AuthError,
    bearer_token,
    clamp_hints,
    clamp_target,
    forwardable_headers,
    redact_headers,
)
from gateway.api.errors import GatewayError
from gateway.dispatch.slo_service import SloService
from gateway.engines import adapter_for
from gateway.settings import EngineConfig, Settings, describe_error, key_fingerprint, load_settings
from policies.slo import SloHints, SloSource, SloTarget
from tests.gateway.conftest import MODEL, BrokenEngine
from tests.gateway.gateway_thread import run_gateway
from tests.gateway.stub_engines import HeaderEngine

CLIENT = "sk-client-0123456789abcdef"
POLICY_KEY = "sk-policy-0123456789abcdef"
ADMIN = "sk-admin-0123456789abcdef"
ENGINE_KEY = "sk-engine-0123456789abcdef"
KEYED: dict[str, Any] = {
    "api_keys": [CLIENT],
    "admin_api_keys": [ADMIN],
    "api_key_policies": {POLICY_KEY: {"tenant": "team-a", "task": "wikisql", "max_priority": 1}},
}


def auth_for(**settings: Any) -> Authenticator:
    return Authenticator(load_settings(**settings))


def bearer(key: str | bytes) -> dict[bytes, bytes]:
    raw = key.encode() if isinstance(key, str) else key
    return {b"authorization": b"Bearer " + raw}


def status_of(check: Any, headers: dict[bytes, bytes]) -> int:
    try:
        check(headers)
    except AuthError as error:
        return error.status
    return 200


# -- parsing the Authorization header ----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "token"),
    [
        (b"Bearer sk-a", b"sk-a"),
        (b"bearer sk-a", b"sk-a"),
        (b"BeArEr sk-a", b"sk-a"),
        (b"  Bearer \t sk-a  ", b"sk-a"),
        (b"Basic sk-a", None),
        (b"sk-a", None),
        (b"Bearer", None),
        (b"Bearer    ", None),
        (b"", None),
        (None, None),
        (b"\xff\xfe\x00", None),
        (b"Bearer \xff\xfe", b"\xff\xfe"),
    ],
)
def test_bearer_scheme_is_case_insensitive_and_tolerates_whitespace(
    value: bytes | None, token: bytes | None
) -> None:
    assert bearer_token(value) == token


def test_only_the_exact_key_matches() -> None:
    """Near misses (last character, a prefix, an extension, another case) are all rejected; a
    comparison that stopped at a prefix or ignored case would let one through."""
    auth = auth_for(api_keys=["sk-abcdef12345"])
    assert auth.client(bearer("sk-abcdef12345")).role == "client"
    assert auth.client({b"authorization": b"bearer   sk-abcdef12345 "}).role == "client"
    for near in (
        "sk-abcdef12346",
        "sk-abcdef1234",
        "sk-abcdef123456",
        "SK-ABCDEF12345",
        "sk-abcdef12345\x00",
    ):
        assert status_of(auth.client, bearer(near)) == 401, near


@given(st.binary(max_size=64))
def test_garbage_authorization_bytes_never_raise(raw: bytes) -> None:
    auth = auth_for(api_keys=["sk-abcdef12345"])
    for value in (raw, b"Bearer " + raw):
        headers = {b"authorization": value}
        if bearer_token(value) == b"sk-abcdef12345":
            continue
        assert auth.identify(headers) is ANONYMOUS
        assert status_of(auth.client, headers) == 401


# -- which key opens which route -----------------------------------------------------------------


def test_client_admin_and_policy_keys_on_each_route() -> None:
    auth = auth_for(**KEYED)
    none: dict[bytes, bytes] = {}
    assert [status_of(auth.client, h) for h in (bearer(CLIENT), bearer(POLICY_KEY), bearer(ADMIN))] == [
        200,
        200,
        403,
    ]
    assert [status_of(auth.admin, h) for h in (bearer(ADMIN), bearer(CLIENT), bearer(POLICY_KEY))] == [
        200,
        403,
        403,
    ]
    assert status_of(auth.client, none) == status_of(auth.admin, none) == status_of(auth.metrics, none) == 401
    assert status_of(auth.admin, bearer("sk-nope")) == 401
    assert status_of(auth.metrics, bearer(CLIENT)) == 403 and status_of(auth.metrics, bearer(ADMIN)) == 200

    identity = auth.client(bearer(POLICY_KEY))
    assert (identity.tenant, identity.task, identity.policy.max_priority) == ("team-a", "wikisql", 1)
    assert identity.key_id == key_fingerprint(POLICY_KEY) and POLICY_KEY not in repr(identity)


def test_401_carries_a_bearer_challenge_and_an_openai_shaped_body() -> None:
    auth = auth_for(**KEYED)
    with pytest.raises(AuthError) as missing:
        auth.admin({})
    with pytest.raises(AuthError) as bad:
        auth.admin(bearer("sk-nope"))
    with pytest.raises(AuthError) as forbidden:
        auth.admin(bearer(CLIENT))
    for error in (missing.value, bad.value):
        ((name, value),) = error.extra_headers
        assert name == b"www-authenticate" and value.startswith(b"Bearer")
        assert error.payload()["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert b"invalid_token" in bad.value.extra_headers[0][1]
    assert forbidden.value.extra_headers == ()
    assert forbidden.value.payload()["error"]["type"] == "permission_error"  # type: ignore[index]


def test_no_keys_means_everything_is_open() -> None:
    auth = auth_for()
    for check in (auth.client, auth.admin, auth.metrics):
        assert check({}) is ANONYMOUS and check(bearer("anything")) is ANONYMOUS


def test_admin_keys_alone_lock_admin_routes_but_not_the_openai_routes() -> None:
    auth = auth_for(admin_api_keys=[ADMIN])
    assert auth.client({}) is ANONYMOUS and auth.client(bearer(ADMIN)) is ANONYMOUS
    assert status_of(auth.admin, {}) == 401 and status_of(auth.admin, bearer(ADMIN)) == 200


def test_public_metrics_need_no_key_but_admin_routes_still_do() -> None:
    auth = auth_for(**KEYED, metrics_public=True)
    assert status_of(auth.metrics, {}) == 200 and status_of(auth.admin, {}) == 401


def test_legacy_task_and_tenant_keys_keep_working() -> None:
    legacy = {"api_key_tasks": {"sk-task-key": "wikisql"}, "api_key_tenants": {"sk-task-key": "team-b"}}
    # without api_keys the routes are open and the key only names a task and tenant, which the
    # client's x-slo-task may still override (as before policies existed)
    identity = auth_for(**legacy).client(bearer("sk-task-key"))
    assert (identity.task, identity.tenant, identity.policy.task_override) == ("wikisql", "team-b", True)
    # with api_keys the key must also be listed there to be accepted
    assert status_of(auth_for(**legacy, api_keys=["sk-other"]).client, bearer("sk-task-key")) == 401
    both = auth_for(**legacy, api_keys=["sk-task-key"]).client(bearer("sk-task-key"))
    assert (both.role, both.task) == ("client", "wikisql")


# -- SLO ceilings --------------------------------------------------------------------------------


@pytest.mark.parametrize(("claimed", "honoured"), [(0, 1), (1, 1), (3, 3), (-5, 1), (None, None)])
def test_a_priority_more_urgent_than_the_key_allows_is_lowered(
    claimed: int | None, honoured: int | None
) -> None:
    # 0 is the most urgent level (policies/priority_mapping.py): "lowered" means a larger number
    assert clamp_hints(SloHints(priority=claimed), ApiKeyPolicy(max_priority=1)).priority == honoured


def test_explicit_targets_tighter_than_the_minimum_are_raised() -> None:
    policy = ApiKeyPolicy(min_ttft_ms=500, min_tpot_ms=50)
    tight = clamp_hints(SloHints(ttft_ms=100, tpot_ms=10), policy)
    assert (tight.ttft_ms, tight.tpot_ms) == (500, 50)
    loose = clamp_hints(SloHints(ttft_ms=900, tpot_ms=80), policy)
    assert (loose.ttft_ms, loose.tpot_ms) == (900, 80)
    assert clamp_hints(SloHints(), policy) == SloHints()  # no claim is not a tight claim


@pytest.mark.parametrize(
    ("key_task", "override", "claimed", "honoured"),
    [
        ("wikisql", False, "medical_qa", "wikisql"),
        ("wikisql", False, None, "wikisql"),
        ("wikisql", True, "medical_qa", "medical_qa"),
        ("wikisql", True, None, "wikisql"),
        (None, False, "medical_qa", "medical_qa"),
        (None, False, None, None),
    ],
)
def test_the_clients_task_replaces_the_keys_only_with_task_override(
    key_task: str | None, override: bool, claimed: str | None, honoured: str | None
) -> None:
    policy = ApiKeyPolicy(task=key_task, task_override=override)
    assert clamp_hints(SloHints(task=claimed), policy).task == honoured


def test_the_tenant_comes_from_the_key() -> None:
    assert clamp_hints(SloHints(tenant="someone-else"), ApiKeyPolicy(tenant="team-a")).tenant == "team-a"


@pytest.mark.parametrize(
    "headers",
    [
        {b"x-priority": b"--1"},
        {b"x-priority": b"1e3"},
        {b"x-slo-ttft-ms": b"nan"},
        {b"x-slo-tpot-ms": b"-4"},
        {b"x-slo-task": b"\xff\xfe"},
    ],
)
def test_malformed_claims_are_a_400_naming_the_header(headers: dict[bytes, bytes]) -> None:
    with pytest.raises(GatewayError) as refused:
        SloService(load_settings()).classify(headers, None)
    assert refused.value.status == 400 and next(iter(headers)).decode() in refused.value.message


def test_final_targets_are_never_tighter_than_the_keys_minimum() -> None:
    target = SloTarget(ttft_s=0.2, tpot_s=0.01, slo_class="medical_qa", source=SloSource.TASK)
    floored = clamp_target(target, ApiKeyPolicy(min_ttft_ms=500, min_tpot_ms=50))
    assert (floored.ttft_s, floored.tpot_s, floored.slo_class) == (0.5, 0.05, "medical_qa")
    assert clamp_target(target, ApiKeyPolicy()) is target


def test_classify_honours_the_keys_ceilings() -> None:
    """End to end through the real SloService with the key's policy."""
    settings = load_settings(
        slo_profile="priority",
        api_key_policies={POLICY_KEY: {"max_priority": 1, "min_ttft_ms": 1200}},
    )
    slo = SloService(settings)
    policy = settings.key_policies()[POLICY_KEY]
    _, priority = slo.classify({b"x-priority": b"0"}, 0, policy)
    assert priority == 1
    assert slo.classify({}, None, policy)[1] is None  # (no priority given)
    # the body's 0 is the most urgent level, as x-priority: 0 is (not vLLM's "no priority"), and
    # lowered to the key's ceiling alike
    assert slo.classify({}, 0, policy)[1] == 1
    explicit = {b"x-slo-ttft-ms": b"300", b"x-slo-tpot-ms": b"400"}
    target, _ = slo.classify(explicit, None, policy)
    # the key's minimum TTFT, and p1's TPOT floor (0.525 s): the key may claim no tighter
    assert (target.ttft_s, target.tpot_s) == (1.2, 0.525)

    tasks = load_settings(api_key_policies={POLICY_KEY: {"task": "wikisql"}})
    task_policy = tasks.key_policies()[POLICY_KEY]
    target, _ = SloService(tasks).classify({b"x-slo-task": b"medical_qa"}, None, task_policy)
    assert target.slo_class == "wikisql"


def test_a_keys_priority_ceiling_binds_targets_from_every_rule() -> None:
    """A key held to priority 3 (no minimums of its own) got tighter targets than its level
    promises by not claiming a priority (the default class, 1.5 s), by naming a task (0.7 s) or by
    asking (1 ms): queue orders by deadline put it ahead of priority 0. Each is floored at its
    level's range now; the mapper's targets for the level stay its own."""
    settings = load_settings(
        slo_profile="hyperflexis-4task", api_key_policies={POLICY_KEY: {"max_priority": 3}}
    )
    slo = SloService(settings)
    policy = settings.key_policies()[POLICY_KEY]
    claimed, priority = slo.classify({b"x-priority": b"0"}, None, policy)
    assert priority == 3 and claimed.ttft_s >= 15.0
    for headers in (
        {},
        {b"x-slo-task": b"medical_qa"},
        {b"x-slo-ttft-ms": b"1", b"x-slo-tpot-ms": b"1"},
        {b"x-slo-ttft-ms": b"1"},
    ):
        target, _ = slo.classify(headers, None, policy)
        assert target.ttft_s >= 15.0 and target.tpot_s >= 0.75, (headers, target)
    # a key without a ceiling, or with the highest level as its ceiling, keeps what it asks for
    # (the floor is for claims the key's level does not allow, not for every key)
    keys = load_settings(
        slo_profile="hyperflexis-4task",
        api_key_policies={"sk-none-0123456789": {"tenant": "t"}, "sk-top-0123456789": {"max_priority": 0}},
    )
    for name in ("sk-none-0123456789", "sk-top-0123456789"):
        target, _ = SloService(keys).classify(
            {b"x-slo-ttft-ms": b"300", b"x-slo-tpot-ms": b"200"}, None, keys.key_policies()[name]
        )
        assert (target.ttft_s, target.tpot_s) == (0.3, 0.2), name
    # the key's own task is the operator's choice, not the client's claim: it stands
    own = load_settings(
        slo_profile="hyperflexis-4task",
        api_key_policies={POLICY_KEY: {"task": "medical_qa", "max_priority": 2}},
    )
    target, _ = SloService(own).classify({}, None, own.key_policies()[POLICY_KEY])
    assert (target.slo_class, target.ttft_s) == ("medical_qa", 0.7)


# -- headers forwarded upstream ------------------------------------------------------------------


async def test_sim_headers_reach_only_simulated_engines_that_are_allowed_them() -> None:
    passthrough = forwardable_headers(
        [
            (b"x-sim-fault", b"hang"),
            (b"traceparent", b"00-abc-def-01"),
            (b"authorization", b"Bearer " + CLIENT.encode()),
            (b"x-sim-output-len", b"\xff"),  # odd bytes are dropped, never raise
            (b"x-sim-\xfe", b"1"),
        ]
    )
    assert set(passthrough) == {"x-sim-fault", "traceparent"}
    async with aiohttp.ClientSession() as session:

        def adapter(kind: str, forward: bool) -> Any:
            config = EngineConfig.model_validate({"url": "http://127.0.0.1:9", "kind": kind, "model": "m"})
            return adapter_for(config, session, 1.0, forward_sim_headers=forward)

        assert set(adapter("sim", True).forwarded_headers(passthrough)) == set(passthrough)
        assert set(adapter("sim", False).forwarded_headers(passthrough)) == {"traceparent"}
        assert set(adapter("vllm", True).forwarded_headers(passthrough)) == {"traceparent"}
        assert adapter("vllm", True).forwarded_headers({"Authorization": "x"}) == {}


def test_forward_sim_headers_is_off_unless_asked() -> None:
    assert load_settings().forward_sim_headers is False
    assert load_settings(forward_sim_headers=True).forward_sim_headers is True


# -- keys never leak -------------------------------------------------------------------------------


def test_redaction_helpers() -> None:
    shown = redact_headers(
        {b"authorization": b"Bearer " + CLIENT.encode(), b"x-api-key": b"k", b"accept": b"*/*"}
    )
    assert shown == {"authorization": "<redacted>", "x-api-key": "<redacted>", "accept": "*/*"}
    assert CLIENT not in key_fingerprint(CLIENT) and key_fingerprint("sk-a") != key_fingerprint("sk-b")


@pytest.mark.parametrize(
    "bad",
    [
        {"api_keys": ["sk-secret-value", "with space"]},
        {"api_keys": ["sk-secret-value"], "admin_api_keys": ["sk-secret-value"]},
        {"api_key_tasks": {"sk-secret-value": 5}},
        {"api_key_policies": {"sk-secret-value": {"max_priority": -1}}},
        {"api_key_policies": {"sk-secret-value": {"unknown": 1}}},
        {"api_key_policies": {"sk-secret-value": {"task": "a"}}, "api_key_tasks": {"sk-secret-value": "b"}},
        {"engines": [{"url": "http://127.0.0.1:9", "model": "m", "api_key": ["sk-secret-value"]}]},
        {"engines": [{"url": "http://u:p@127.0.0.1:9", "model": "m", "api_key": "sk-secret-value"}]},
    ],
)
def test_a_bad_configuration_never_prints_a_key(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        load_settings(**bad)
    line = describe_error(info.value)
    assert "secret" not in line and "secret" not in str(info.value), line
    assert line.split(":")[0] in {
        "api_keys",
        "settings",
        "api_key_tasks",
        "api_key_policies",
        "engines.0.api_key",
        "engines.0",
    }


def test_settings_repr_hides_every_key() -> None:
    settings = Settings(
        **KEYED,
        api_key_tasks={"sk-task-secret": "wikisql"},
        engines=[
            EngineConfig.model_validate({"url": "http://127.0.0.1:9", "model": "m", "api_key": ENGINE_KEY})
        ],
    )
    text = repr(settings)
    for key in (CLIENT, ADMIN, POLICY_KEY, ENGINE_KEY, "sk-task-secret"):
        assert key not in text
    assert "api_keys='<1 redacted>'" in text


# -- a real gateway --------------------------------------------------------------------------------


def test_admin_routes_need_an_admin_key() -> None:
    with run_gateway(**KEYED) as gw:

        def get(path: str, key: str | None = None, scheme: str = "Bearer") -> httpx.Response:
            headers = {"Authorization": f"{scheme} {key}"} if key else {}
            return httpx.get(gw.url + path, headers=headers)

        missing = get("/admin/engines")
        assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
        assert missing.json()["error"]["type"] == "authentication_error"
        assert get("/admin/engines", "sk-wrong").status_code == 401
        forbidden = get("/admin/engines", CLIENT)
        assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
        assert "www-authenticate" not in forbidden.headers
        assert get("/admin/engines", ADMIN).status_code == 200
        assert get("/admin/engines", ADMIN, scheme="bEARER").status_code == 200
        assert get("/admin/engines/", CLIENT).status_code == 403  # a trailing slash is no way round
        assert get("/admin/no-such-route").status_code == 401  # no hint at which routes exist
        assert get("/admin/no-such-route", ADMIN).status_code == 404
        # the API description lists every admin route: as closed as they are
        assert get("/openapi.json").status_code == 401 and get("/openapi.json", CLIENT).status_code == 403
        assert "/admin/engines" in get("/openapi.json", ADMIN).json()["paths"]

        assert get("/metrics").status_code == 401 and get("/metrics", CLIENT).status_code == 403
        assert get("/metrics", ADMIN).status_code == 200
        assert get("/v1/models").status_code == 401 and get("/v1/models", ADMIN).status_code == 403
        assert get("/v1/models", CLIENT).status_code == 200
        assert (
            get("/health").status_code == 200 and get("/ready").status_code == 503
        )  # no engines: open, honest


def test_public_metrics() -> None:
    with run_gateway(**KEYED, metrics_public=True) as gw:
        assert httpx.get(gw.url + "/metrics").status_code == 200
        assert httpx.get(gw.url + "/admin/engines").status_code == 401


def test_no_key_appears_in_metrics_logs_or_admin_output(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # serve() makes the slogate logger stop propagating; caplog listens at the root
    monkeypatch.setattr(logging.getLogger("slogate"), "propagate", True)
    caplog.set_level(logging.DEBUG)
    with BrokenEngine(500) as engine:
        entry = {"url": engine.url, "kind": "sim", "model": MODEL, "name": "broken", "api_key": ENGINE_KEY}
        with_password = {
            "url": engine.url.replace("http://", "http://user:engine-password@"),
            "model": "other",
            "name": "with-password",
        }
        with run_gateway(**KEYED, engines=[entry, with_password], log_requests=True) as gw:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            statuses = {}
            for key in (CLIENT, POLICY_KEY, ADMIN, "sk-wrong-" + CLIENT):
                r = httpx.post(
                    gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
                statuses[key] = r.status_code
            # the request reached the engine with the client key and was refused with a wrong one
            assert statuses[CLIENT] == 500 and statuses["sk-wrong-" + CLIENT] == 401, statuses
            admin = {"Authorization": f"Bearer {ADMIN}"}
            metrics_text = httpx.get(gw.url + "/metrics", headers=admin).text
            engines_text = httpx.get(gw.url + "/admin/engines", headers=admin).text
            assert "broken" in metrics_text and "broken" in engines_text
    for key in (CLIENT, POLICY_KEY, ADMIN, ENGINE_KEY):
        assert key not in metrics_text and key not in engines_text and key not in caplog.text, key
    assert "engine-password" not in engines_text


def test_a_key_with_a_policy_sees_routing_decisions_only_when_it_allows() -> None:
    """``x-slogate-debug: 1`` answers with the routing decision, which says how much of the prompt
    each engine holds cached: prefix roots are per model, adapter and cache_salt, not per tenant,
    so a restricted tenant could probe what another's prompts left cached. A key with a policy
    sees decisions only with ``decisions: true``; a plain key's claims stand as made."""
    open_key = "sk-policy-decisions-0123456789"
    policies = {**KEYED["api_key_policies"], open_key: {"tenant": "team-b", "decisions": True}}
    with (
        HeaderEngine() as engine,
        run_gateway(
            **{**KEYED, "api_key_policies": policies},
            engines=[engine.entry("e0")],
            routing_profile="round-robin",
        ) as gw,
    ):

        def decision(key: str) -> str | None:
            headers = {"Authorization": f"Bearer {key}", "x-slogate-debug": "1"}
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            return r.headers.get("x-slogate-decision")

        assert decision(POLICY_KEY) is None
        assert decision(open_key) is not None and decision(CLIENT) is not None


def test_a_role_flip_needs_a_json_body_and_a_running_gateway() -> None:
    """With no admin keys (the default) a web page open on the same machine could flip an
    engine's role: a text/plain POST needs no CORS preflight. And a flip asked for while the
    gateway stops began a drain that the shutdown's cut ended half-way."""
    engines = [
        {"url": "http://127.0.0.1:9", "kind": "sim", "model": MODEL, "name": "e0"},
        {"url": "http://127.0.0.1:10", "kind": "sim", "model": MODEL, "name": "e1"},
    ]
    with run_gateway(engines=engines, monitor_interval_s=30) as gw:
        url = gw.url + "/admin/engines/e0/role"
        body = '{"role": "prefill", "allow_gap": true}'
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": content_type} if content_type else {}
            answer = httpx.post(url, content=body, headers=headers)
            assert answer.status_code == 415, (content_type, answer.text)
            assert answer.json()["error"]["code"] == "unsupported_media_type"
        assert gw.gateway.fleet.records["e0"].adapter.role.value == "collocated"
        # stopping begins while the body is still arriving (it may take up to body_timeout_s)
        host, port = gw.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                b"POST /admin/engines/e0/role HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body[:5].encode()
            )
            time.sleep(0.3)
            gw.gateway.stopping = True  # (what begin_shutdown sets as the server stops accepting)
            sock.sendall(body[5:].encode())
            assert sock.recv(65536).startswith(b"HTTP/1.1 503 ")
        assert not gw.gateway.fleet.records["e0"].draining
        answer = httpx.post(url, json={"role": "prefill", "allow_gap": True})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
        assert answer.headers["retry-after"] == "1" and not gw.gateway.fleet.records["e0"].draining
