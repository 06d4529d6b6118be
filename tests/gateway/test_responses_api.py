"""The Responses API with the official openai SDK, through the gateway, in front of two simulated
engines that store their responses as vLLM does (``VLLM_ENABLE_RESPONSES_API_STORE=1``): answers
streamed and not, a conversation continued with ``previous_response_id`` always on the engine
that stored it (least load would spread it), even once the gateway has forgotten where that was,
reads and cancels of a stored response, and the refusals a client meets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.procs import ChildProcess
from gateway.serving.responses import ResponseHomes
from tests.gateway.conftest import MODEL, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway
from tests.gateway.test_timeouts import metric


@pytest.fixture(scope="module")
def gw(two_engines: list[ChildProcess]) -> Iterator[RunningGateway]:
    with run_gateway(engines=[engine_entry(e) for e in two_engines], monitor_interval_s=0.2) as running:
        yield running


@pytest.fixture()
def client(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def _create(client: openai.OpenAI, **kw: object) -> tuple[openai.types.responses.Response, str]:
    """A response and the engine that served it."""
    raw = client.responses.with_raw_response.create(model=MODEL, max_output_tokens=6, **kw)  # type: ignore[call-overload]
    return raw.parse(), raw.headers["x-slogate-engine"]


def test_a_response_streamed_and_not(client: openai.OpenAI, gw: RunningGateway) -> None:
    ttft0 = metric(gw, "slogate_time_to_first_token_seconds_count", model=MODEL, slo_class="default")
    tokens0 = metric(gw, "slogate_tokens_total", model=MODEL, kind="completion")
    whole, _ = _create(client, input="Say something short.")
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage is not None and whole.usage.input_tokens > 0
    with client.responses.stream(model=MODEL, input="Say something short.", max_output_tokens=6) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas and "".join(deltas) == final.output_text
    assert final.usage is not None and final.usage.input_tokens == whole.usage.input_tokens
    assert (
        metric(gw, "slogate_time_to_first_token_seconds_count", model=MODEL, slo_class="default") == ttft0 + 1
    )
    counted = metric(gw, "slogate_tokens_total", model=MODEL, kind="completion") - tokens0
    assert counted == whole.usage.output_tokens + final.usage.output_tokens


def test_a_conversation_stays_on_the_engine_that_stored_it(client: openai.OpenAI, gw: RunningGateway) -> None:
    first, home = _create(client, input="Remember the word teal.")
    previous, inputs = first, [first.usage.input_tokens if first.usage else 0]
    for turn in range(5):
        answer, engine = _create(client, input=f"And now turn {turn}?", previous_response_id=previous.id)
        assert engine == home, f"turn {turn} went to {engine}, its conversation is on {home}"
        assert answer.previous_response_id == previous.id and answer.usage is not None
        inputs.append(answer.usage.input_tokens)
        previous = answer
    # each turn's prompt carries the conversation so far (the engine built it from its store)
    assert inputs == sorted(inputs) and inputs[-1] > inputs[0] + 5 * 4
    # stored responses are read (and cancelled) where they live
    read = client.responses.retrieve(first.id)
    assert read.id == first.id and read.output_text == first.output_text
    with pytest.raises(openai.BadRequestError) as synchronous:
        client.responses.cancel(first.id)
    assert "synchronous" in synchronous.value.message


def test_the_engine_is_found_again_once_the_gateway_forgot(client: openai.OpenAI, gw: RunningGateway) -> None:
    """A replica that did not serve the first turn, or one restarted, knows nothing of it: the
    engines are asked."""
    first, home = _create(client, input="Remember the word plum.")
    assert gw.gateway.proxy is not None
    gw.gateway.proxy.responses.homes = ResponseHomes()
    for turn in range(3):
        _, engine = _create(client, input=f"turn {turn}", previous_response_id=first.id)
        assert engine == home
    # the engine's answer tells how long the conversation is: the continuation is planned with it
    found = gw.gateway.proxy.responses.homes.get(first.id)
    assert first.usage is not None and found is not None
    assert found.tokens == first.usage.input_tokens + first.usage.output_tokens
    gw.gateway.proxy.responses.homes = ResponseHomes()
    assert client.responses.retrieve(first.id).id == first.id


def test_unknown_and_unstored_responses_are_404s(client: openai.OpenAI, gw: RunningGateway) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        _create(client, input="hi", previous_response_id="resp_" + "0" * 32)
    assert unknown.value.body["code"] == "response_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "1" * 32)
    unstored, _ = _create(client, input="Forget this.", store=False)
    assert gw.gateway.proxy is not None and gw.gateway.proxy.responses.homes.get(unstored.id) is None
    with pytest.raises(openai.NotFoundError):
        _create(client, input="What did I say?", previous_response_id=unstored.id)


def test_what_the_gateway_refuses(gw: RunningGateway) -> None:
    background = httpx.post(
        gw.url + "/v1/responses", json={"model": MODEL, "input": "x", "background": True}, timeout=10
    )
    assert background.status_code == 400 and background.json()["error"]["param"] == "background"
    bad_input = httpx.post(gw.url + "/v1/responses", json={"model": MODEL, "input": 5}, timeout=10)
    assert bad_input.status_code == 400 and bad_input.json()["error"]["param"] == "input"
    unknown_model = httpx.post(gw.url + "/v1/responses", json={"model": "nope", "input": "x"}, timeout=10)
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["code"] == "model_not_found"
    for path, method in (("/v1/responses/resp_x", "POST"), ("/v1/responses/resp_x/cancel", "GET")):
        wrong = httpx.request(method, gw.url + path, timeout=10)
        assert wrong.status_code == 405 and "allow" in wrong.headers, path
    odd = httpx.get(gw.url + "/v1/responses/" + "%2F..%2Fmetrics", timeout=10)
    assert odd.status_code == 404 and odd.json()["error"]
    stored = httpx.post(gw.url + "/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 2})
    for query in ("stream=true", "stream=1"):
        replay = httpx.get(gw.url + f"/v1/responses/{stored.json()['id']}?{query}", timeout=10)
        assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream", query
    for sneaky in ("../../health", "x?a=1", "x#f", "%2e%2e/metrics", "a/b"):
        refused = httpx.post(
            gw.url + "/v1/responses",
            json={"model": MODEL, "input": "x", "previous_response_id": sneaky},
            timeout=10,
        )
        assert refused.status_code == 400, sneaky
        assert refused.json()["error"]["param"] == "previous_response_id", sneaky


def test_a_tenant_cannot_read_or_continue_another_tenants_response(two_engines: list[ChildProcess]) -> None:
    keys = {"sk-team-a-0123456789": {"tenant": "a"}, "sk-team-b-0123456789": {"tenant": "b"}}
    with run_gateway(
        engines=[engine_entry(e) for e in two_engines], api_keys=list(keys), api_key_policies=keys
    ) as gw:
        team_a, team_b = (openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0) for key in keys)
        theirs, _ = _create(team_a, input="A secret of team a.")
        with pytest.raises(openai.NotFoundError):
            team_b.responses.retrieve(theirs.id)
        with pytest.raises(openai.NotFoundError):
            _create(team_b, input="What was it?", previous_response_id=theirs.id)
        with pytest.raises(openai.NotFoundError):
            team_b.responses.cancel(theirs.id)
        assert team_a.responses.retrieve(theirs.id).output_text == theirs.output_text
        anonymous = httpx.get(gw.url + f"/v1/responses/{theirs.id}", timeout=10)
        assert anonymous.status_code == 401


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
_ITEMS = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])
            | _ANY,
            "role": st.sampled_from(["user", "assistant", "system", "developer"]) | _ANY,
            "content": st.text(max_size=20)
            | st.lists(
                st.fixed_dictionaries(
                    {
                        "type": st.sampled_from(["input_text", "input_image"]) | _ANY,
                        "text": st.text(max_size=10) | _ANY,
                    }
                ),
                max_size=2,
            )
            | _ANY,
            "call_id": _ANY,
            "output": _ANY,
        },
    )
    | _ANY,
    max_size=3,
)
_FIELDS = {
    "model": st.just(MODEL) | _ANY,
    "input": st.text(max_size=30) | _ITEMS | _ANY,
    "instructions": st.text(max_size=20) | _ANY,
    "max_output_tokens": st.integers(-2, 8) | _ANY,
    "stream": st.booleans() | _ANY,
    "store": st.booleans() | _ANY,
    "previous_response_id": st.sampled_from(["resp_" + "0" * 32, ""]) | _ANY,
    "temperature": st.floats(-1, 3) | _ANY,
    "priority": st.integers(-3, 3) | _ANY,
    "tools": _ANY,
}


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    st.fixed_dictionaries(
        {"model": st.just(MODEL), "input": _FIELDS["input"]},
        optional={k: v for k, v in _FIELDS.items() if k not in ("model", "input")},
    )
    | st.dictionaries(st.sampled_from(list(_FIELDS)), _ANY, max_size=5)
)
def test_any_body_gets_an_answer_or_an_openai_error_never_a_500(
    gw: RunningGateway, body: dict[str, Any]
) -> None:
    try:
        raw = orjson.dumps(body)
    except (TypeError, orjson.JSONEncodeError):
        raw = b'{"model": 1}'
    answer = httpx.post(
        gw.url + "/v1/responses", content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert answer.status_code < 500 or answer.status_code == 503, answer.text[:500]
    if answer.status_code != 200:
        error = answer.json()["error"]
        assert isinstance(error["message"], str) and error["message"], answer.text[:500]
    elif answer.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in answer.content.split(b"\n\n") if e]
        assert events and b'"response.completed"' in events[-1], answer.text[-500:]
    else:
        assert answer.json()["object"] == "response"
