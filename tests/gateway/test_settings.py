"""Settings: env prefix, YAML file, precedence, and a one-line exit-2 error for bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from gateway.settings import describe_error, load_settings
from profiles import PROFILES_DIR
from tests.gateway.gateway_thread import run_gateway

ENGINE = {"url": "http://127.0.0.1:9", "kind": "sim", "model": "m"}


def test_yaml_then_env_then_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "port: 7001\nmonitor_interval_s: 0.5\nengines:\n  - {url: 'http://127.0.0.1:9', model: m}\n"
    )
    assert load_settings(cfg).port == 7001
    monkeypatch.setenv("SLOGATE_PORT", "7002")
    settings = load_settings(cfg)
    assert (settings.port, settings.monitor_interval_s) == (7002, 0.5)
    assert settings.engines[0].kind == "vllm" and settings.engines[0].engine_id == "127.0.0.1:9"
    assert load_settings(cfg, port=7003).port == 7003


def test_engines_from_env_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOGATE_ENGINES", '[{"url": "http://127.0.0.1:5", "model": "a", "name": "e1"}]')
    assert load_settings().engines[0].engine_id == "e1"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"port": 70000}, "port: Input should be less than or equal to 65535"),
        ({"engines": [{"url": "not a url", "model": "m"}]}, "engines.0.url"),
        ({"engines": [{**ENGINE, "kind": "tgi"}]}, "engines.0.kind"),
        ({"engines": [ENGINE, ENGINE]}, "duplicate engine id '127.0.0.1:9'"),
        # the known names follow profiles/routing, which grows: only the start of the list is fixed
        ({"routing_profile": "nope"}, "routing profile 'nope' not found; known: ['"),
        ({"monitor_interval_s": 0}, "monitor_interval_s: Input should be greater than 0"),
        ({"unknown_key": 1}, "unknown_key: Extra inputs are not permitted"),
    ],
)
def test_bad_values_name_the_key(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        load_settings(**overrides)
    assert fragment in describe_error(info.value)


def test_cli_exits_2_with_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("port: many\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "port" in lines[0] and "integer" in lines[0], proc.stderr


def test_a_misspelt_variable_exits_2_naming_it_not_its_value() -> None:
    """The file refuses unknown keys, but a misspelt SLOGATE_API_KEY was ignored without a word:
    the gateway started open to all."""
    import os

    env = {**os.environ, "SLOGATE_API_KEY": '["sk-team-secret"]', "SLOGATE_CACHE_DIR": "/tmp/x"}
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "SLOGATE_API_KEY names no setting" in lines[0], proc.stderr
    assert "SLOGATE_API_KEYS?" in lines[0] and "sk-team-secret" not in proc.stderr


def test_variables_of_other_tools_and_of_engine_keys_are_not_settings_and_are_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.settings import unknown_variable

    monkeypatch.setenv("SLOGATE_MY_ENGINE_KEY", "sk-engine")
    settings = load_settings(
        engines=[{"url": "http://e:8000", "model": "m", "api_key_env": "SLOGATE_MY_ENGINE_KEY"}]
    )
    allowed = {
        "SLOGATE_CACHE_DIR": "/x",
        "SLOGATE_REAL_ENGINES": "0",
        "SLOGATE_BIND": "0.0.0.0",
        "SLOGATE_ENGINE_API_KEY_0": "k",
        "SLOGATE_MY_ENGINE_KEY": "k",  # (named by an engine's api_key_env)
        "SLOGATE_MONITOR_INTERVAL_S": "1",
        "SLOGATE_OTLP_HEADERS__authorization": "x",
        "OTHER": "1",
        # Kubernetes' service links for Services named slogate and slogate-engine-0
        "SLOGATE_SERVICE_HOST": "10.0.0.1",
        "SLOGATE_SERVICE_PORT": "8000",
        "SLOGATE_SERVICE_PORT_HTTP": "8000",
        "SLOGATE_PORT_8000_TCP": "tcp://10.0.0.1:8000",
        "SLOGATE_PORT_8000_TCP_ADDR": "10.0.0.1",
        "SLOGATE_ENGINE_0_PORT": "tcp://10.0.0.2:8000",
        "SLOGATE_ENGINE_0_PORT_8000_TCP_PROTO": "tcp",
    }
    assert unknown_variable(allowed, settings) is None
    assert unknown_variable({**allowed, "SLOGATE_MONITOR_INTERVAL": "1"}, settings) == (
        "SLOGATE_MONITOR_INTERVAL names no setting (did you mean SLOGATE_MONITOR_INTERVAL_S?)"
    )
    # a *_PORT is a service link only by its value: a misspelt port setting is still refused
    metrics_port = unknown_variable({**allowed, "SLOGATE_METRICS_PORT": "9090"}, settings)
    assert metrics_port is not None and metrics_port.startswith("SLOGATE_METRICS_PORT names no setting")


@pytest.mark.parametrize(
    ("profile_key", "edit", "fragment"),
    [
        (
            "routing_profile",
            ("routing/least-load.yaml", "name: least_load", "name: no_such_scorer"),
            "no_such_scorer",
        ),
        ("slo_profile", ("slo/priority.yaml", "ttft_s: [0.525, 0.875]", "ttft_s: [0.9, 0.1]"), "min <= max"),
    ],
)
def test_a_bad_profile_exits_2_with_its_reason(
    tmp_path: Path, profile_key: str, edit: tuple[str, str, str], fragment: str
) -> None:
    source, old, new = edit
    text = (PROFILES_DIR / source).read_text()
    assert old in text
    profile = tmp_path / "profile.yaml"
    profile.write_text(text.replace(old, new, 1))
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(f'{profile_key}: {profile}\nengines:\n  - {{url: "http://127.0.0.1:9", model: m}}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and fragment in proc.stderr, proc.stderr
    assert "listening" not in proc.stdout


@pytest.mark.parametrize(
    ("where", "text", "fragment"),
    [
        ("routing", "[1, 2]\n", "must be a mapping"),
        ("routing", "name: x: y\n", "not valid YAML"),
        ("routing", "dispatcher: 5\n", "profile.yaml"),
        ("engine", "latency: 5\n", "name"),
        ("engine", "name: [\n", "not valid YAML"),
    ],
)
def test_a_malformed_profile_file_exits_2_with_one_line(
    tmp_path: Path,
    where: str,
    text: str,
    fragment: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Routing profiles that are not a mapping or not YAML, and engine latency profiles that do not
    validate, ended in a traceback (exit 1) instead of the one-line configuration error.
    (In process: ``serve`` is what ``slogate serve`` runs once its settings load.)"""
    from gateway import server

    monkeypatch.setattr(server, "setup_logging", lambda level: None)
    monkeypatch.setattr(server, "_AnnouncingGateway", None)  # (never reached: nothing may listen)
    profile = tmp_path / "profile.yaml"
    profile.write_text(text)
    engine: dict[str, object] = {"url": "http://127.0.0.1:9", "model": "m"}
    if where == "engine":
        engine["latency_profile"] = str(profile)
    routing = {"routing_profile": str(profile)} if where == "routing" else {}
    settings = load_settings(engines=[engine], **routing)
    with pytest.raises(SystemExit) as info:
        server.serve(settings)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and fragment in err and len(err.strip().splitlines()) == 1, err


def test_keepalive_must_be_positive_and_below_the_engines() -> None:
    assert load_settings().upstream_keepalive_s == 4.0
    # (at or past the engines' own 5 s the pool reuses connections the engine is closing: the
    # health checks' pool has no fresh-connection retry, and engines were ejected for it)
    for bad in (0, -1, float("inf"), 5.0, 30):
        with pytest.raises(ValidationError) as info:
            load_settings(upstream_keepalive_s=bad)
        assert describe_error(info.value).startswith("upstream_keepalive_s")


@pytest.mark.parametrize(
    "key",
    ["connect_timeout_s", "pool_timeout_s", "health_timeout_s", "scrape_timeout_s", "request_timeout_s"],
)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_no_timeout_takes_inf_or_nan(key: str, bad: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """An infinite connect timeout was accepted, then overflowed in aiohttp on every request (a
    500 each); an infinite health timeout failed every check and ejected every engine."""
    with pytest.raises(ValidationError) as info:
        load_settings(**{key: bad})
    assert describe_error(info.value).startswith(key)
    monkeypatch.setenv(f"SLOGATE_{key.upper()}", "inf")
    with pytest.raises(ValidationError):
        load_settings()


def test_an_engines_numbers_take_no_inf() -> None:
    with pytest.raises(ValidationError) as info:
        load_settings(engines=[{**ENGINE, "time_scale": float("inf")}])
    assert "time_scale" in describe_error(info.value)


def test_upstream_keepalive_reaches_the_connector() -> None:
    with run_gateway(upstream_keepalive_s=2.5) as gw:
        assert gw.gateway.session is not None
        assert gw.gateway.session.connector._keepalive_timeout == 2.5  # type: ignore[union-attr]


def test_key_settings_from_yaml_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "api_keys: [sk-a]\n"
        "api_key_tasks: {sk-a: wikisql}\n"
        "api_key_policies:\n"
        "  sk-b: {task: medical_qa, task_override: false, max_priority: 1, min_ttft_ms: 500, tenant: team-b}\n"
    )
    monkeypatch.setenv("SLOGATE_ADMIN_API_KEYS", '["sk-admin"]')
    monkeypatch.setenv("SLOGATE_METRICS_PUBLIC", "true")
    settings = load_settings(cfg)
    assert settings.client_keys() == {"sk-a", "sk-b"} and settings.admin_api_keys == ["sk-admin"]
    assert settings.metrics_public and not settings.forward_sim_headers
    policies = settings.key_policies()
    assert (policies["sk-a"].task, policies["sk-a"].task_override) == ("wikisql", True)
    b = policies["sk-b"]
    assert (b.task, b.task_override, b.max_priority, b.min_ttft_ms, b.tenant) == (
        "medical_qa",
        False,
        1,
        500,
        "team-b",
    )


def test_engine_key_from_an_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """api_key_env names a variable (a Secret in the pod) read when the settings load: the key is
    in no file; a Secret made from a file keeps its trailing newline, which is dropped."""
    key = "sk-engine-from-env-0123456789"
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "engines:\n"
        "  - {url: 'https://vllm.example:8000', model: m, name: e0, api_key_env: SLOGATE_TEST_ENGINE_KEY}\n"
    )
    assert key not in config.read_text()
    monkeypatch.setenv("SLOGATE_TEST_ENGINE_KEY", key + "\n")
    (engine,) = load_settings(config).engines
    assert engine.api_key == key and engine.api_key_env == "SLOGATE_TEST_ENGINE_KEY"
    assert key not in repr(engine) and key not in repr(load_settings(config))


@pytest.mark.parametrize(
    ("engine", "env", "fragment"),
    [
        ({"api_key_env": "SLOGATE_TEST_ENGINE_KEY"}, None, "SLOGATE_TEST_ENGINE_KEY is not set or empty"),
        ({"api_key_env": "SLOGATE_TEST_ENGINE_KEY"}, "  ", "SLOGATE_TEST_ENGINE_KEY is not set or empty"),
        ({"api_key_env": "SLOGATE_TEST_ENGINE_KEY"}, "sk bad", "non-empty printable text without whitespace"),
        ({"api_key_env": "SLOGATE_TEST_ENGINE_KEY", "api_key": "sk-x"}, "sk-y", "not both"),
        ({"api_key_env": "NOT-A-NAME"}, None, "api_key_env"),
        (
            {"api_key_env": "SLOGATE_TEST_ENGINE_KEY", "url": "https://u:p@vllm.example:8000"},
            "sk-y",
            "either as api_key or in the URL",
        ),
    ],
)
def test_engine_key_env_errors(
    engine: dict[str, object], env: str | None, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLOGATE_TEST_ENGINE_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("SLOGATE_TEST_ENGINE_KEY", env)
    entry = {"url": "https://vllm.example:8000", "model": "m", **engine}
    with pytest.raises(ValidationError) as info:
        load_settings(engines=[entry])
    message = describe_error(info.value)
    assert fragment in message, message
    for secret in ("sk-x", "sk-y", "sk bad"):
        assert secret not in message


@pytest.mark.parametrize(
    "url",
    [
        "http://vllm:s3cr3t-PASSWORD@10.0.0.5:800000",  # a bad port
        "http://vllm:s3cr3t-PASSWORD@10.0.0.5:8000/v1",  # the API path given
        "vllm:s3cr3t-PASSWORD@10.0.0.5:8000",  # no scheme
        "http://vllm:s3cr3t-PASSWORD/x@10.0.0.5:800000",  # a "/" in the password
        "http://vllm:s3cr3t-PASSWORD@x@10.0.0.5:800000",  # an "@" in it
    ],
)
def test_a_bad_engine_url_is_reported_without_its_password(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error printed the whole URL, password included (the admin API hides it)."""
    with pytest.raises(ValidationError) as info:
        load_settings(engines=[{"url": url, "model": "m"}])
    message = describe_error(info.value)
    assert "s3cr3t-PASSWORD" not in message and "engines.0.url" in message, message
    monkeypatch.setenv("SLOGATE_ENGINES", orjson.dumps([{"url": url, "model": "m"}]).decode())
    with pytest.raises(ValidationError) as info:
        load_settings()
    assert "s3cr3t-PASSWORD" not in describe_error(info.value)


def test_a_key_whose_task_names_no_class_is_refused_at_startup() -> None:
    """A misspelt task fell back to the default class on every request of that key, unnoticed.
    The message names the key by its fingerprint, never the key."""
    from gateway.dispatch.slo_service import SloService
    from policies.api import PolicyConfigError

    for keys in (
        {"api_key_policies": {"sk-secret-42": {"task": "wikisqll"}}},
        {"api_keys": ["sk-secret-42"], "api_key_tasks": {"sk-secret-42": "wikisqll"}},
    ):
        with pytest.raises(PolicyConfigError) as info:
            SloService(load_settings(**keys))
        assert "'wikisqll'" in str(info.value) and "wikisql" in str(info.value).split("defined:")[1]
        assert "sk-secret-42" not in str(info.value)
    SloService(load_settings(api_key_policies={"sk-secret-42": {"task": "wikisql"}}))


@pytest.mark.parametrize("url", ["http://vllm:8000/v1", "http://vllm:8000/v1/", "http://proxy/team/v1"])
def test_an_engine_url_with_the_api_path_is_refused_with_the_address_to_give(url: str) -> None:
    """The OpenAI convention's base URL ends in /v1; the gateway adds /v1/... itself, so such an
    engine answered every health check 404 and was never healthy, with nothing saying why."""
    with pytest.raises(ValidationError) as raised:
        load_settings(None, engines=[{"url": url, "model": "m"}])
    assert "without the API path" in str(raised.value)
    assert url.rstrip("/").removesuffix("/v1") in str(raised.value)


@pytest.mark.parametrize(
    "name", ["rack1/gpu0", "gpu?0", "gpu#0", "gpu%2F0", "gpu 0", "gpu\n0", "gpu\x000", "gpü"]
)
def test_an_engine_name_that_is_no_path_segment_or_header_value_is_refused(name: str) -> None:
    """The name is a path segment of /admin/engines/{id}/role (with a slash it could never be
    addressed, 404 with or without %2F) and every answer's x-slogate-engine header: a control
    character there made uvicorn drop each connection after the engine had done the work."""
    with pytest.raises(ValidationError):
        load_settings(None, engines=[{"url": "http://vllm:8000", "model": "m", "name": name}])
    assert load_settings(None, engines=[{"url": "http://vllm:8000", "model": "m", "name": "rack1-gpu0:[a]"}])


def test_one_server_and_model_declared_twice_is_refused() -> None:
    """Under two names one engine was counted as two: its scraped load read twice, a per-engine
    load limit doubled. One server serving two models is two engines."""
    twice = [
        {"url": "http://vllm:8000", "model": "m", "name": "a"},
        {"url": "http://vllm:8000/", "model": "m", "name": "b"},
    ]
    with pytest.raises(ValidationError, match="one entry per model"):
        load_settings(None, engines=twice)
    assert load_settings(None, engines=[twice[0], {**twice[1], "model": "other"}])


def test_a_nested_variable_for_a_case_sensitive_mapping_is_refused_without_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SLOGATE_API_KEY_POLICIES__Sk-TeamA__MAX_PRIORITY=1 reached the settings as 'sk-teama': the
    key never matched (401). Refused; the error names the setting, never the key."""
    monkeypatch.setenv("SLOGATE_API_KEY_POLICIES__Sk-TeamA-Secret__MAX_PRIORITY", "1")
    with pytest.raises(ValueError) as raised:
        load_settings(None)
    assert "api_key_policies" in str(raised.value) and "JSON" in str(raised.value)
    assert "Sk-TeamA" not in str(raised.value) and "sk-teama" not in str(raised.value)
    monkeypatch.delenv("SLOGATE_API_KEY_POLICIES__Sk-TeamA-Secret__MAX_PRIORITY")
    monkeypatch.setenv("SLOGATE_API_KEY_POLICIES", '{"Sk-TeamA-Secret": {"max_priority": 1}}')
    assert list(load_settings(None).api_key_policies) == ["Sk-TeamA-Secret"]


def test_the_body_budget_must_hold_one_largest_body() -> None:
    """Bodies over 64 KiB may use three quarters of max_body_memory_bytes: a budget whose share
    is below max_body_bytes would refuse every largest body, whatever else is held."""
    assert load_settings(None, max_body_bytes=150_000, max_body_memory_bytes=200_000)
    with pytest.raises(ValueError, match="max_body_memory_bytes"):
        load_settings(None, max_body_bytes=150_001, max_body_memory_bytes=200_000)
    # bodies of 64 KiB or less may use the whole budget
    assert load_settings(None, max_body_bytes=65_536, max_body_memory_bytes=65_536)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://h:6379/0?ssl=true", "the Redis client refuses it"),  # (every store call raised)
        ("redis://h:6379/abc", "the database must be a number"),  # (database 0, without a word)
        ("rediss://h/0?ssl_cert_reqs=bogus", "the Redis client refuses it"),  # (its own error type)
    ],
)
def test_a_redis_url_the_client_cannot_use_is_refused_at_load(url: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        load_settings(engines=[], state_store="redis", redis_url=url)
    assert fragment in describe_error(info.value)
    for good in (
        "redis://:pw@h:6379/0?socket_timeout=2",
        "rediss://h:6380/1?ssl_cert_reqs=none",
        "unix:///run/redis.sock?db=1",
        "redis://h:6379/0/",  # (as the client reads them: database 0, and 1)
        "redis://h/%31",
    ):
        assert load_settings(engines=[], state_store="redis", redis_url=good).redis_url == good


@pytest.mark.parametrize("key", ["yes", "on", "null", "8000"])
def test_a_yaml_key_that_is_not_a_name_is_one_clear_error(key: str, tmp_path: Path) -> None:
    """YAML reads yes, on, null and 8000 as a boolean, none and a number: the settings took them
    as keyword names, a TypeError and a traceback."""
    path = tmp_path / "gateway.yaml"
    path.write_text(f"{key}: 1\n")
    with pytest.raises(ValueError, match="is not a setting's name"):
        load_settings(path)


def test_a_file_setting_the_environment_overrides_is_said_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The image sets SLOGATE_HOST and SLOGATE_PORT: a mounted file's host and port were not
    used, and nothing said so."""
    path = tmp_path / "gateway.yaml"
    path.write_text("port: 9000\nlog_level: info\n")
    monkeypatch.setenv("SLOGATE_PORT", "9001")
    with caplog.at_level("WARNING", logger="slogate.settings"):
        settings = load_settings(path)
    assert settings.port == 9001 and settings.log_level.lower() == "info"
    said = [r.getMessage() for r in caplog.records if r.name == "slogate.settings"]
    assert said == [f"port in {path} is not used: the environment's SLOGATE_PORT is"], said


def test_settings_that_defeat_each_other_are_warned_of() -> None:
    from gateway.settings import settings_warnings

    assert settings_warnings(load_settings(engines=[])) == []
    (warning,) = settings_warnings(load_settings(engines=[], monitor_interval_s=10, stale_after_s=0.5))
    assert warning.startswith("stale_after_s (0.5) is not above monitor_interval_s (10)")


@pytest.mark.parametrize(
    ("endpoint", "bind", "fragment"),
    [
        ("engine:5557", False, "give tcp://host:port or ipc://path"),
        ("http://engine:5557", False, "give tcp://host:port or ipc://path"),
        ("tcp://engine", False, "give tcp://host:port or ipc://path"),
        ("tcp://engine:5557/x", False, "give tcp://host:port or ipc://path"),
        ("tcp://engine:99999", False, "port 99999 is not in 1-65535"),
        ("tcp://*:5557", False, "* is the address an engine binds"),  # (vLLM's own example value)
        ("ipc://", False, "give tcp://host:port or ipc://path"),
    ],
)
def test_a_kv_event_endpoint_zmq_cannot_use_is_refused_at_load(
    endpoint: str, bind: bool, fragment: str
) -> None:
    """A ZMQ socket refuses a bad address only when the subscriber starts: it then retried and
    logged forever, and the prefix index never heard an event."""
    engine = {"url": "http://127.0.0.1:8001", "model": "m"}
    for field in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        with pytest.raises(ValidationError) as info:
            load_settings(engines=[{**engine, field: endpoint, "kv_events_bind": bind}])
        assert fragment in describe_error(info.value), field
    for good, bind in (
        ("tcp://engine-0.ns.svc:5557", False),
        ("tcp://10.0.0.7:5557", False),
        ("tcp://[::1]:5557", False),
        ("tcp://*:5557", True),  # the gateway binds; the engine connects
        ("ipc:///run/vllm/kv-events", False),
    ):
        settings = load_settings(engines=[{**engine, "kv_events_endpoint": good, "kv_events_bind": bind}])
        assert settings.engines[0].kv_events_endpoint == good
