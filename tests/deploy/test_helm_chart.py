"""The Helm chart: rendered by Helm's own engine, every manifest checked against Kubernetes' schemas.

Helm runs from its Go SDK (``helm-python-sdk``, see ``toolchain.py``): the same template engine,
values coalescing and ``values.schema.json`` enforcement as ``helm template``. Manifests are
validated with ``kubernetes-validate`` (the API server's OpenAPI schemas, strict: unknown fields
fail) for the oldest and newest Kubernetes versions the chart claims; the ServiceMonitor, a CRD,
against the Prometheus Operator's models. The gateway's settings file the chart writes is loaded
by the gateway's own settings code.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, get_args

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.app import create_app
from gateway.settings import EngineConfig, EngineKind, Settings, load_settings
from policies.api import Role
from policies.slo import parse_slo_profile
from tests.deploy.conftest import CHART, REPO, HelmCall

#: oldest (autoscaling/v2, policy/v1 and topology spread are long GA there) and newest checked
KUBE_VERSIONS = ("1.27.0", "1.37.0")
VALUES_FILES = {"default": None, "demo": "values-demo.yaml", "pd": "values-pd.yaml"}
#: values-pd.yaml requires keys (none ships with the chart): the tests give these
PD_CLIENT_KEY, PD_ADMIN_KEY = "sk-pd-client-0123456789abcdef", "sk-pd-admin-0123456789abcdef"
PD_KEYS = {"apiKeys": {"clientKeys": [PD_CLIENT_KEY], "adminKeys": [PD_ADMIN_KEY]}}
#: settings the chart sets itself rather than through gateway.config
CHART_MANAGED = {
    "host": "SLOGATE_HOST env (0.0.0.0 in the pod)",
    "allowed_hosts": "not checked in the pod: it listens on 0.0.0.0, reached by Service names",
    "engine_tokenizers": "not offered: the pod mounts no tokenizer directory (read-only root, no extra "
    "volumes), so every pod given one crash-looped at start; docker compose can mount one",
    "port": "SLOGATE_PORT env from gateway.port",
    "engines": "gateway.engines + vllm.* + simEngines.*",
    "api_keys": "Secret (apiKeys.clientKeys / existingSecret)",
    "admin_api_keys": "Secret (apiKeys.adminKeys / existingSecret)",
    "api_key_policies": "Secret (apiKeys.policies / existingSecret)",
    "api_key_tasks": "superseded by api_key_policies (key -> task), which the Secret carries",
    "api_key_tenants": "superseded by api_key_policies (key -> tenant), which the Secret carries",
    "profiles_dir": "the image's profiles; extra ones through profiles.*",
    "otlp_headers": "Secret (otlpHeaders.headers / existingSecret): the collector's credentials",
    "state_store": "SLOGATE_STATE_STORE env from stateStore.mode (auto: redis with more than one replica)",
    "redis_url": "SLOGATE_REDIS_URL env: stateStore.redis.url / existingSecret, or the chart's own Redis",
    "replica_id": "SLOGATE_REPLICA_ID env: the pod's name",
    "state_namespace": "SLOGATE_STATE_NAMESPACE env: stateStore.namespace, else the release's full name",
}
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _file_values(name: str) -> dict[str, Any]:
    file = VALUES_FILES[name]
    return yaml.safe_load((CHART / file).read_text()) if file else {}


def _values(name: str) -> dict[str, Any]:
    """A values file as the README's install command uses it (the P/D file with keys given)."""
    values = _file_values(name)
    return _coalesce(values, PD_KEYS) if name == "pd" else values


def _coalesce(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of a values file over the defaults: maps merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _coalesce(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def _render(helm: HelmCall, values: dict[str, Any], release: str = "rel") -> list[dict[str, Any]]:
    answer = helm("render", values, release=release)
    assert answer["ok"], answer["error"]
    docs: list[dict[str, Any]] = []
    for path, text in answer["result"]["manifests"].items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__source__"] = path
                docs.append(doc)
    return docs


def _notes(helm: HelmCall, values: dict[str, Any]) -> str:
    answer = helm("render", values)
    assert answer["ok"], answer["error"]
    return str(next(v for k, v in answer["result"]["manifests"].items() if k.endswith("NOTES.txt")))


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _component(docs: list[dict[str, Any]], kind: str, component: str | None) -> list[dict[str, Any]]:
    """The ``kind`` objects of one component (None: those of none, such as the API keys' Secret)."""
    return [
        d
        for d in _by_kind(docs, kind)
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]


def _gateway_env(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (gateway,) = _component(docs, "Deployment", "gateway")
    return {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}


# --- values and schema -----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_values_files_satisfy_values_schema(name: str) -> None:
    merged = _coalesce(yaml.safe_load((CHART / "values.yaml").read_text()), _values(name))
    jsonschema.Draft7Validator.check_schema(_schema())
    errors = sorted(jsonschema.Draft7Validator(_schema()).iter_errors(merged), key=str)
    assert not errors, [f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors]


@pytest.mark.parametrize(
    ("override", "where"),
    [
        ({"gateway": {"config": {"no_such_setting": 1}}}, "gateway/config"),
        ({"gateway": {"config": {"log_level": "loud"}}}, "gateway/config/log_level"),
        ({"gateway": {"config": {"monitor_interval_s": 0}}}, "gateway/config/monitor_interval_s"),
        (
            {"gateway": {"engines": [{"url": "http://e:8000", "model": "m", "kind": "tgi"}]}},
            "gateway/engines/0/kind",
        ),
        (
            {"gateway": {"engines": [{"url": "http://e:8000", "model": "m", "api_key": "x"}]}},
            "gateway/engines/0",
        ),
        (  # a URL's user:password would be written to the ConfigMap
            {"gateway": {"engines": [{"url": "https://user:pass@e:8000/v1", "model": "m"}]}},
            "gateway/engines/0/url",
        ),
        (
            {"gateway": {"engines": [{"url": "http://e:8000", "model": "m", "api_key_env": "K"}]}},
            "gateway/engines/0",
        ),
        ({"gateway": {"pdb": {"minAvailable": 1.5}}}, "gateway/pdb/minAvailable"),
        # a PDB that allows no eviction at all would hang every node drain
        ({"gateway": {"pdb": {"maxUnavailable": 0}}}, "gateway/pdb/maxUnavailable"),
        ({"gateway": {"pdb": {"maxUnavailable": "0%"}}}, "gateway/pdb/maxUnavailable"),
        ({"gateway": {"pdb": {"minAvailable": "100%"}}}, "gateway/pdb/minAvailable"),
        # what the gateway refuses at start-up: an API path, names no route or header can carry
        (
            {"gateway": {"engines": [{"url": "http://e:8000/v1", "model": "m"}]}},
            "gateway/engines/0/url",
        ),
        (
            {"gateway": {"engines": [{"url": "http://e:8000", "model": "m", "name": "a/b"}]}},
            "gateway/engines/0/name",
        ),
        (
            {"gateway": {"engines": [{"url": "http://e:8000", "model": "m", "name": ""}]}},
            "gateway/engines/0/name",
        ),
        # a SecretKeySelector without its key: the ServiceMonitor CRD refuses it
        (
            {"serviceMonitor": {"bearerTokenSecret": {"name": "prom-token"}}},
            "serviceMonitor/bearerTokenSecret",
        ),
        ({"simEngines": {"role": "both"}}, "simEngines/role"),
        ({"apiKeys": {"clientKeys": ["has space"]}}, "apiKeys/clientKeys/0"),
        # a password in the URL would be written to the pod spec: it goes in existingSecret
        ({"stateStore": {"redis": {"url": "redis://:pw@r:6379/0"}}}, "stateStore/redis/url"),
        ({"stateStore": {"redis": {"url": "redis://r:6379/0?password=pw"}}}, "stateStore/redis/url"),
        ({"stateStore": {"mode": "etcd"}}, "stateStore/mode"),
        ({"gateway": {"config": {"replica_sync_interval_s": 0}}}, "gateway/config/replica_sync_interval_s"),
        (  # not a ZMQ address: the subscriber retried it forever
            {
                "gateway": {
                    "engines": [{"url": "http://e:8000", "model": "m", "kv_events_endpoint": "e:5557"}]
                }
            },
            "gateway/engines/0/kv_events_endpoint",
        ),
        (  # a port past 65535
            {
                "gateway": {
                    "engines": [{"url": "http://e:8000", "model": "m", "kv_events_endpoint": "tcp://e:99999"}]
                }
            },
            "gateway/engines/0/kv_events_endpoint",
        ),
        (  # vLLM's own bind address, where the gateway connects (kv_events_bind not set)
            {
                "gateway": {
                    "engines": [{"url": "http://e:8000", "model": "m", "kv_events_endpoint": "tcp://*:5557"}]
                }
            },
            "gateway/engines/0/kv_events_endpoint",
        ),
    ],
)
def test_values_schema_refuses_bad_values(helm: HelmCall, override: dict[str, Any], where: str) -> None:
    """The schema catches what the gateway would refuse at start-up, and Helm enforces it."""
    merged = _coalesce(yaml.safe_load((CHART / "values.yaml").read_text()), override)
    errors = list(jsonschema.Draft7Validator(_schema()).iter_errors(merged))
    assert [e for e in errors if "/".join(map(str, e.absolute_path)) == where], [
        str(e.message) for e in errors
    ]
    answer = helm("render", override)
    assert not answer["ok"] and "schema" in answer["error"], answer


def test_values_schema_tracks_every_gateway_setting() -> None:
    """gateway.config admits exactly the settings the chart does not set itself, with their enums;
    a setting added to gateway/settings.py fails here until the chart knows it."""
    schema = _schema()["properties"]["gateway"]["properties"]
    config_keys = set(schema["config"]["properties"])
    settings = set(Settings.model_fields)
    assert config_keys <= settings, f"not settings: {sorted(config_keys - settings)}"
    assert not config_keys & set(CHART_MANAGED), sorted(config_keys & set(CHART_MANAGED))
    missing = settings - config_keys - set(CHART_MANAGED)
    assert not missing, (
        f"settings unknown to the chart: {sorted(missing)}; add them to "
        "helm/slogate/values.schema.json (gateway.config) or to CHART_MANAGED with how the chart sets them"
    )
    log_levels = schema["config"]["properties"]["log_level"]["enum"]
    assert log_levels == list(get_args(Settings.model_fields["log_level"].annotation))
    engine = schema["engines"]["items"]
    # keys never go to the ConfigMap: the chart sets api_key_env from api_key_secret itself
    assert set(engine["properties"]) == set(EngineConfig.model_fields) - {"api_key", "api_key_env"} | {
        "api_key_secret"
    }
    assert engine["properties"]["kind"]["enum"] == list(get_args(EngineKind))
    assert engine["properties"]["role"]["enum"] == [r.value for r in Role]
    sim_roles = _schema()["properties"]["simEngines"]["properties"]["role"]["enum"]
    assert sim_roles == [r.value for r in Role]


# --- rendering ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_chart_renders_and_every_manifest_validates(
    helm: HelmCall, service_monitor_model: type[Any], name: str
) -> None:
    docs = _render(helm, _values(name))
    assert {"Deployment", "Service", "ConfigMap"} <= {doc["kind"] for doc in docs}, name
    for doc in docs:
        source = doc.pop("__source__")
        where = f"{source}: {doc['kind']} {doc['metadata']['name']}"
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            model = service_monitor_model.model_validate(doc)
            # the models ignore unknown fields: a round trip that loses one shows it
            assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc, where
        else:
            for version in KUBE_VERSIONS:
                error = None
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    error = f"{exc.message} at {list(exc.path)}"
                assert error is None, f"{where} invalid for Kubernetes {version}: {error}"
        assert len(doc["metadata"]["name"]) <= 63 and DNS_1035.match(doc["metadata"]["name"]), where


def test_lint_is_clean(helm: HelmCall) -> None:
    for name in VALUES_FILES:
        answer = helm("lint", _values(name))
        assert answer["ok"], answer
        report = answer["result"]
        assert report["total_charts_linted"] == 1
        assert not report["errors"], (name, report["errors"])
        assert not [m for m in report["messages"] if m["severity"] >= 2], (name, report["messages"])


def test_default_values_gateway_shape(helm: HelmCall) -> None:
    docs = _render(helm, {})
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "Deployment",  # (the replicas' Redis: the HPA may run up to 10)
            "HorizontalPodAutoscaler",
            "PodDisruptionBudget",
            "Secret",  # (its password)
            "Service",
            "Service",
            "ServiceAccount",
        ]
    )
    (deploy,) = _component(docs, "Deployment", "gateway")
    spec = deploy["spec"]
    assert "replicas" not in spec, "the HPA owns the replica count"
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert {c["topologyKey"] for c in pod["topologySpreadConstraints"]} == {
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    # the Service's links (SLOGATE_SERVICE_HOST, SLOGATE_PORT=tcp://...) would land among the
    # gateway's own SLOGATE_* settings
    assert pod["enableServiceLinks"] is False
    (hpa,) = _by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    (pdb,) = _by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    (svc,) = _component(docs, "Service", "gateway")
    assert svc["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert "WARNING: no engines" in _notes(helm, {})


def test_probe_paths_are_gateway_routes() -> None:
    """/health and /ready, which the chart and the image probe, are real routes of the gateway."""
    app = create_app(load_settings(engines=[]))
    paths = {getattr(r, "path", None) for r in app.api.routes}
    assert {"/health", "/ready", "/metrics"} <= paths


def _gateway_config(docs: list[dict[str, Any]], tmp_path: Path) -> Settings:
    """Load the rendered gateway.yaml with the gateway's own settings code, with the chart's profile
    ConfigMap laid out where the pod mounts it (under tmp_path instead of /etc/slogate)."""
    maps = {d["metadata"]["name"]: d for d in _by_kind(docs, "ConfigMap")}
    gateway_map = next(d for d in maps.values() if "gateway.yaml" in d["data"])
    text = gateway_map["data"]["gateway.yaml"]
    profiles = next((d for n, d in maps.items() if n.endswith("-profiles")), None)
    if profiles is not None:
        for key, body in profiles["data"].items():
            kind, name, _ = key.split(".", 2)
            target = tmp_path / "profiles" / kind / f"{name}.yaml"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(body)
        text = text.replace("/etc/slogate/", f"{tmp_path}/")
    config = tmp_path / "gateway.yaml"
    config.write_text(text)
    return load_settings(config)


def test_demo_values_run_simulated_engines(helm: HelmCall, tmp_path: Path) -> None:
    docs = _render(helm, _values("demo"))
    deployments = {d["metadata"]["name"]: d for d in _by_kind(docs, "Deployment")}
    engines = sorted(n for n in deployments if "-sim-" in n)
    assert engines == ["rel-slogate-sim-0", "rel-slogate-sim-1"]
    services = {d["metadata"]["name"] for d in _by_kind(docs, "Service")}
    assert set(engines) <= services
    settings = _gateway_config(docs, tmp_path)
    assert [(e.name, e.kind, e.base_url) for e in settings.engines] == [
        (n, "sim", f"http://{n}:8001") for n in engines
    ]
    # the custom SLO profile reaches the gateway, and parses as one
    assert Path(settings.slo_profile).name == "demo-2task.yaml"
    profile = parse_slo_profile(settings.slo_profile_path().read_text())
    assert set(profile.classes) == {"chat", "batch"}
    create_app(settings)  # the routing and SLO profiles together pass the gateway's own checks
    args = deployments[engines[0]]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "sim-engine" and args[args.index("--engine-id") + 1] == engines[0]
    assert not _by_kind(docs, "HorizontalPodAutoscaler") and not _by_kind(docs, "PodDisruptionBudget")


def test_pd_values_register_roles_and_keys(
    helm: HelmCall, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _render(helm, _values("pd"))
    settings = _gateway_config(docs, tmp_path)
    roles = sorted(e.role.value for e in settings.engines)
    assert roles == ["collocated", "decode", "decode", "prefill"]
    assert all(e.kind == "vllm" and e.priority_scheduling for e in settings.engines)
    vllm = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
        for d in _by_kind(docs, "Deployment")
        if "-vllm-" in d["metadata"]["name"]
    }
    assert len(vllm) == 4
    for name, container in vllm.items():
        # (the collocated one too: an admin may flip it into either pool, see below)
        assert "--kv-transfer-config" in container["args"], name
        assert container["args"][container["args"].index("--served-model-name") + 1] == "qwen-7b"
    (secret,) = _component(docs, "Secret", None)
    gateway = next(d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"] == "rel-slogate")
    env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    # the keys reach the gateway as the pod gets them: environment variables from the Secret
    for variable, key in (("SLOGATE_API_KEYS", "api-keys"), ("SLOGATE_ADMIN_API_KEYS", "admin-api-keys")):
        ref = env[variable]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] == key
        monkeypatch.setenv(variable, secret["stringData"][key])
    keys = load_settings(tmp_path / "gateway.yaml")
    assert keys.client_keys() == {PD_CLIENT_KEY} and keys.admin_api_keys == [PD_ADMIN_KEY]
    monitors = {d["metadata"]["name"]: d for d in _by_kind(docs, "ServiceMonitor")}
    assert set(monitors) == {"rel-slogate", "rel-slogate-engines"}
    credentials = monitors["rel-slogate"]["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert secret["stringData"][credentials["key"]] == PD_ADMIN_KEY
    assert "serve the model disaggregated" in " ".join(_notes(helm, _values("pd")).split())


def test_pd_values_ship_no_key_and_require_them(helm: HelmCall) -> None:
    """values-pd.yaml holds no key: installed as is, rendering fails saying what to give."""
    assert "apiKeys" not in json.dumps(_file_values("pd")).replace('"apiKeys": {"required": true}', "")
    answer = helm("render", _file_values("pd"))
    assert not answer["ok"] and "apiKeys.required" in answer["error"], answer
    for partial in ({"clientKeys": [PD_CLIENT_KEY]}, {"adminKeys": [PD_ADMIN_KEY]}):
        answer = helm("render", _coalesce(_file_values("pd"), {"apiKeys": partial}))
        assert not answer["ok"] and "apiKeys.required" in answer["error"], partial
    own = _coalesce(
        _file_values("pd"),
        {
            "apiKeys": {"existingSecret": "team-keys"},
            "serviceMonitor": {"bearerTokenSecret": {"name": "s", "key": "k"}},
        },
    )
    assert helm("render", own)["ok"]


def test_existing_secret_is_referenced_not_created(helm: HelmCall) -> None:
    docs = _render(helm, {"apiKeys": {"existingSecret": "team-keys"}})
    assert not _component(docs, "Secret", None)
    gateway = _by_kind(docs, "Deployment")[0]
    env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    for name in ("SLOGATE_API_KEYS", "SLOGATE_ADMIN_API_KEYS", "SLOGATE_API_KEY_POLICIES"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "team-keys" and ref["optional"] is True


def test_required_keys_in_an_existing_secret_are_not_optional(helm: HelmCall) -> None:
    """With keys required and an existing Secret, all three references were optional: a Secret
    not there yet (or named wrong, or its keys spelt otherwise) started the gateway with no keys,
    every route open. Now such a pod does not start."""
    values = {
        "apiKeys": {"existingSecret": "team-keys", "required": True},
        "serviceMonitor": {"bearerTokenSecret": {"name": "s", "key": "k"}},
    }
    gateway = _by_kind(_render(helm, values), "Deployment")[0]
    env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    refs = {
        name: env[name]["valueFrom"]["secretKeyRef"]
        for name in env
        if name.endswith(("API_KEYS", "POLICIES"))
    }
    assert (
        refs["SLOGATE_API_KEYS"]["optional"] is False and refs["SLOGATE_ADMIN_API_KEYS"]["optional"] is False
    )
    assert refs["SLOGATE_API_KEY_POLICIES"]["optional"] is True  # (policies are optional by nature)
    assert {ref["name"] for ref in refs.values()} == {"team-keys"}


def test_tracing_settings_and_otlp_headers(
    helm: HelmCall, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracing settings go to gateway.yaml; the collector's headers only to a Secret, from which
    the gateway reads them as its settings code parses SLOGATE_OTLP_HEADERS."""
    values = {
        "gateway": {"config": {"tracing": True, "otlp_endpoint": "http://collector:4318/v1/traces"}},
        "otlpHeaders": {"headers": {"authorization": "Bearer collector-token"}},
    }
    docs = _render(helm, values)
    settings = _gateway_config(docs, tmp_path)
    assert settings.tracing and settings.otlp_endpoint == "http://collector:4318/v1/traces"
    assert not any("collector-token" in json.dumps(d) for d in _by_kind(docs, "ConfigMap"))
    (secret,) = _component(docs, "Secret", None)
    gateway = _by_kind(docs, "Deployment")[0]
    env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["SLOGATE_OTLP_HEADERS"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    monkeypatch.setenv("SLOGATE_OTLP_HEADERS", secret["stringData"][ref["key"]])
    parsed = load_settings(tmp_path / "gateway.yaml")
    assert parsed.otlp_headers == {"authorization": "Bearer collector-token"}


def test_long_release_name_keeps_names_valid(helm: HelmCall) -> None:
    docs = _render(helm, _values("pd"), release="a-very-long-release-name-for-a-team-cluster-x")
    for doc in docs:
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and DNS_1035.match(name), name
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"]
    assert len(names) == len(set(names))


# --- credentials, scraping, disruption and shutdown --------------------------------------------

ENGINE_SECRET = {"name": "engine-keys", "key": "vllm-0"}


def test_engine_keys_come_from_a_secret(
    helm: HelmCall, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's api_key_secret becomes an environment variable from that Secret; the ConfigMap
    names the variable only, and the gateway's settings code reads the key from it."""
    engines = [
        {
            "url": "https://vllm-a.example:8000",
            "model": "qwen-7b",
            "name": "a",
            "api_key_secret": ENGINE_SECRET,
        },
        {"url": "https://vllm-b.example:8000", "model": "qwen-7b", "name": "b"},
    ]
    docs = _render(helm, {"gateway": {"engines": engines}})
    gateway = _by_kind(docs, "Deployment")[0]
    env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SLOGATE_ENGINE_API_KEY_0"]["valueFrom"]["secretKeyRef"] == ENGINE_SECRET
    assert "SLOGATE_ENGINE_API_KEY_1" not in env
    (config,) = [d for d in _by_kind(docs, "ConfigMap") if "gateway.yaml" in d["data"]]
    written = yaml.safe_load(config["data"]["gateway.yaml"])["engines"]
    assert written[0]["api_key_env"] == "SLOGATE_ENGINE_API_KEY_0" and "api_key_secret" not in written[0]
    assert "api_key_env" not in written[1]
    monkeypatch.setenv("SLOGATE_ENGINE_API_KEY_0", "sk-engine-from-the-secret\n")
    settings = _gateway_config(docs, tmp_path)
    assert [e.api_key for e in settings.engines] == ["sk-engine-from-the-secret", None]


def test_no_credential_in_any_config_map(helm: HelmCall) -> None:
    """Every credential the values can carry (client, admin and engine keys, collector headers)
    lands in a Secret or a Secret reference, never in a ConfigMap."""
    secrets = ["sk-cm-client-0123456789", "sk-cm-admin-0123456789", "Bearer collector-token-0123"]
    values = _coalesce(
        _values("demo"),
        {
            "apiKeys": {"clientKeys": [secrets[0]], "adminKeys": [secrets[1]], "policies": {secrets[0]: {}}},
            "otlpHeaders": {"headers": {"authorization": secrets[2]}},
            "gateway": {
                "config": {"tracing": True},
                "engines": [
                    {"url": "https://vllm.example:8000", "model": "m", "api_key_secret": ENGINE_SECRET}
                ],
            },
            "serviceMonitor": {"enabled": True},
        },
    )
    docs = _render(helm, values)
    maps = _by_kind(docs, "ConfigMap")
    assert maps
    for config_map in maps:
        text = json.dumps(config_map)
        for secret in secrets:
            assert secret not in text, (config_map["metadata"]["name"], secret)
        for engine in yaml.safe_load(config_map["data"].get("gateway.yaml", "{}")).get("engines", []):
            assert "api_key" not in engine and "@" not in engine["url"], engine
    assert {secrets[0], secrets[1]} <= set(
        json.dumps(_by_kind(docs, "Secret")).replace('\\"', '"').split('"')
    )


def _monitors(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"] for d in _by_kind(docs, "ServiceMonitor")}


def test_service_monitors_never_send_the_admin_key_to_engines(helm: HelmCall) -> None:
    """Endpoint credentials go to every Service a monitor selects: the gateway's monitor (with the
    admin key) selects the gateway's Service only; the engines' has no credentials."""
    values = _coalesce(
        _values("demo"),
        {
            "apiKeys": {"clientKeys": ["sk-sm-client-0123456789"], "adminKeys": ["sk-sm-admin-0123456789"]},
            "gateway": {"config": {"metrics_public": False}},
            "serviceMonitor": {"enabled": True},
        },
    )
    docs = _render(helm, values)
    monitors = _monitors(docs)
    assert set(monitors) == {"rel-slogate", "rel-slogate-engines"}
    services = {d["metadata"]["name"]: d["metadata"]["labels"] for d in _by_kind(docs, "Service")}

    def selected(spec: dict[str, Any]) -> set[str]:
        match = spec["selector"]["matchLabels"]
        assert "matchExpressions" not in spec["selector"]
        return {name for name, labels in services.items() if match.items() <= labels.items()}

    assert selected(monitors["rel-slogate"]) == {"rel-slogate"}
    assert selected(monitors["rel-slogate-engines"]) == {"rel-slogate-sim-0", "rel-slogate-sim-1"}
    (gateway_endpoint,) = monitors["rel-slogate"]["endpoints"]
    assert gateway_endpoint["authorization"]["credentials"]["key"] == "metrics-token"
    assert all("authorization" not in e for e in monitors["rel-slogate-engines"]["endpoints"])
    # no engines in the chart: no engine monitor
    plain = _render(helm, {"serviceMonitor": {"enabled": True}})
    assert set(_monitors(plain)) == {"rel-slogate"}


def test_service_monitor_without_a_token_fails_to_render(helm: HelmCall) -> None:
    """Keys set, /metrics not public and no admin key to give: every scrape would be a 401, so the
    render fails saying what to set."""
    client_only = {
        "apiKeys": {"clientKeys": ["sk-sm-client-0123456789"]},
        "serviceMonitor": {"enabled": True},
    }
    for values in (
        client_only,
        {"apiKeys": {"existingSecret": "team-keys"}, "serviceMonitor": {"enabled": True}},
    ):
        answer = helm("render", values)
        assert not answer["ok"] and "serviceMonitor" in answer["error"], answer
        assert "bearerTokenSecret" in answer["error"] and "metrics_public" in answer["error"]
    public = _monitors(
        _render(helm, _coalesce(client_only, {"gateway": {"config": {"metrics_public": True}}}))
    )
    assert "authorization" not in public["rel-slogate"]["endpoints"][0]
    token = {"name": "prom-token", "key": "token"}
    given = _monitors(_render(helm, _coalesce(client_only, {"serviceMonitor": {"bearerTokenSecret": token}})))
    assert given["rel-slogate"]["endpoints"][0]["authorization"]["credentials"] == token
    # no keys at all: /metrics is open, nothing to present
    assert (
        "authorization"
        not in _monitors(_render(helm, {"serviceMonitor": {"enabled": True}}))["rel-slogate"]["endpoints"][0]
    )


@pytest.mark.parametrize(
    ("gateway", "expected"),
    [
        ({}, {"maxUnavailable": 1}),
        ({"autoscaling": {"minReplicas": 1}}, {"maxUnavailable": 1}),  # evictable at one replica
        ({"autoscaling": {"enabled": False}, "replicas": 3}, {"maxUnavailable": 1}),
        ({"autoscaling": {"minReplicas": 3}, "pdb": {"minAvailable": 2}}, {"minAvailable": 2}),
        ({"pdb": {"minAvailable": "50%"}}, {"minAvailable": "50%"}),
        ({"autoscaling": {"enabled": False}, "replicas": 1}, None),  # one fixed replica: no PDB
    ],
)
def test_pdb_never_blocks_evictions(
    helm: HelmCall, gateway: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    pdbs = _by_kind(_render(helm, {"gateway": gateway}), "PodDisruptionBudget")
    if expected is None:
        assert not pdbs
        return
    (pdb,) = pdbs
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == expected


@pytest.mark.parametrize(
    "gateway",
    [
        {"autoscaling": {"minReplicas": 1}, "pdb": {"minAvailable": 1}},
        {"autoscaling": {"minReplicas": 2}, "pdb": {"minAvailable": 2}},
        {"autoscaling": {"enabled": False}, "replicas": 2, "pdb": {"minAvailable": 3}},
    ],
)
def test_an_unsatisfiable_pdb_fails_to_render(helm: HelmCall, gateway: dict[str, Any]) -> None:
    answer = helm("render", {"gateway": gateway})
    assert not answer["ok"] and "would block every eviction" in answer["error"], answer


def test_a_stopping_gateway_drains(helm: HelmCall) -> None:
    """A preStop sleep (endpoints stop sending before SIGTERM) and a grace period above it."""
    pod = _by_kind(_render(helm, {}), "Deployment")[0]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert pod["terminationGracePeriodSeconds"] == 120
    tuned = _by_kind(_render(helm, {"gateway": {"preStopSleepSeconds": 0}}), "Deployment")[0]
    assert "lifecycle" not in tuned["spec"]["template"]["spec"]["containers"][0]
    answer = helm("render", {"gateway": {"preStopSleepSeconds": 30, "terminationGracePeriodSeconds": 30}})
    assert not answer["ok"] and "terminationGracePeriodSeconds" in answer["error"], answer


def _grace_env(helm: HelmCall, gateway: dict[str, Any]) -> str | None:
    pod = _by_kind(_render(helm, {"gateway": gateway}), "Deployment")[0]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    return env.get("SLOGATE_SHUTDOWN_GRACE_S")


def test_a_stopping_gateway_ends_what_is_open_before_the_kill(helm: HelmCall) -> None:
    """The gateway's own grace ends 10 s before the pod's (preStop sleep taken out): what is open
    then is ended with answers that say so, not cut by the kill."""
    assert _grace_env(helm, {}) == "105"  # 120 - 5 - 10
    assert _grace_env(helm, {"terminationGracePeriodSeconds": 30, "preStopSleepSeconds": 0}) == "20"
    assert _grace_env(helm, {"terminationGracePeriodSeconds": 12, "preStopSleepSeconds": 5}) == "0"
    # given in the gateway's settings, it is not overridden (the environment would win)
    assert _grace_env(helm, {"config": {"shutdown_grace_s": 50}}) is None
    # ... but one the pod's kill would cut short is refused (it rendered, and streams were cut)
    answer = helm("render", {"gateway": {"config": {"shutdown_grace_s": 300}}})
    assert not answer["ok"] and "shutdown_grace_s" in answer["error"], answer
    # the kill came as the grace ended, when the gateway begins ending streams with an answer
    answer = helm("render", {"gateway": {"config": {"shutdown_grace_s": 115}}})
    assert not answer["ok"] and "5 s to end what is open" in answer["error"], answer
    assert _grace_env(helm, {"config": {"shutdown_grace_s": 110}}) is None  # (120 - 5 - 5: just fits)


def test_vllm_pods_are_locked_down_and_request_resources(helm: HelmCall) -> None:
    vllm = [
        d for d in _by_kind(_render(helm, _values("pd")), "Deployment") if "-vllm-" in d["metadata"]["name"]
    ]
    assert len(vllm) >= 2  # (the P/D values run a prefill and a decode engine at least)
    for doc in vllm:
        pod = doc["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), doc["metadata"]["name"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_sim_engines_can_schedule_by_deadline(helm: HelmCall, tmp_path: Path) -> None:
    """simEngines.priorityScheduling: the engines start with --scheduling-policy priority and the
    gateway sends them the priority (what an engine_scheduling: deadline profile needs)."""
    values = _coalesce(
        _values("demo"),
        {
            "simEngines": {"priorityScheduling": True},
            "gateway": {"config": {"routing_profile": "least-load-deadline"}},
        },
    )
    docs = _render(helm, values)
    sims = [d for d in _by_kind(docs, "Deployment") if "-sim-" in d["metadata"]["name"]]
    assert sims
    for doc in sims:
        args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--scheduling-policy") + 1] == "priority"
    settings = _gateway_config(docs, tmp_path)
    assert settings.engines and all(e.priority_scheduling for e in settings.engines)
    create_app(settings)
    # off by default: first come, first served, and the gateway sends no priority
    default = _render(helm, _values("demo"))
    args = next(d for d in _by_kind(default, "Deployment") if "-sim-" in d["metadata"]["name"])["spec"][
        "template"
    ]["spec"]["containers"][0]["args"]
    assert "--scheduling-policy" not in args


def test_every_vllm_engine_of_a_disaggregated_release_runs_the_kv_connector(helm: HelmCall) -> None:
    """The gateway lets an admin flip any vLLM engine into the prefill or decode pool: a
    collocated one launched without the KV connector then failed every prefill (502) or
    recomputed every prompt. Without P/D engines, none needs it."""
    vllm = [
        d for d in _by_kind(_render(helm, _values("pd")), "Deployment") if "-vllm-" in d["metadata"]["name"]
    ]
    assert {d["metadata"]["labels"]["slogate.io/role"] for d in vllm} == {"collocated", "prefill", "decode"}
    for doc in vllm:
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        assert "--kv-transfer-config" in container["args"], doc["metadata"]["name"]
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in {e["name"] for e in container["env"]}
    collocated_only = _coalesce(
        _values("pd"),
        {"vllm": {"collocated": {"replicas": 1}, "prefill": {"replicas": 0}, "decode": {"replicas": 0}}},
    )
    vllm = [
        d for d in _by_kind(_render(helm, collocated_only), "Deployment") if "-vllm-" in d["metadata"]["name"]
    ]
    assert vllm and all(
        "--kv-transfer-config" not in d["spec"]["template"]["spec"]["containers"][0]["args"] for d in vllm
    )
    # ...unless its model's prefill and decode engines run outside the chart (gateway.engines)
    external = [
        {"url": f"http://outside-{role}:8000", "model": "qwen-7b", "role": role, "kind": "vllm"}
        for role in ("prefill", "decode")
    ]
    with_external = _coalesce(collocated_only, {"gateway": {"engines": external}})
    vllm = [
        d for d in _by_kind(_render(helm, with_external), "Deployment") if "-vllm-" in d["metadata"]["name"]
    ]
    assert vllm and all(
        "--kv-transfer-config" in d["spec"]["template"]["spec"]["containers"][0]["args"] for d in vllm
    )


def test_a_changed_engine_profile_restarts_the_simulated_engines(helm: HelmCall) -> None:
    """A new profiles.engines text restarted the gateway (its ConfigMap checksum) but not the
    simulated engines, which kept the latency profile they had read at start."""

    def sim_annotations(profile_text: str) -> list[dict[str, str]]:
        values = _coalesce(
            _values("demo"),
            {"profiles": {"engines": {"custom": profile_text}}, "simEngines": {"profile": "custom"}},
        )
        sims = [d for d in _by_kind(_render(helm, values), "Deployment") if "-sim-" in d["metadata"]["name"]]
        assert sims
        return [d["spec"]["template"]["metadata"].get("annotations", {}) for d in sims]

    profile = (REPO / "profiles" / "engines" / "qwen-7b.yaml").read_text()
    first, second = sim_annotations(profile), sim_annotations(profile + "\n# tuned\n")
    assert all("checksum/profiles" in a for a in first)
    assert first != second


@pytest.mark.parametrize(
    ("gateway", "ok"),
    [
        ({"replicas": 2, "pdb": {"minAvailable": "60%"}}, False),  # 1.2 rounds up to 2 of 2
        ({"replicas": 2, "pdb": {"minAvailable": "90%"}}, False),
        ({"replicas": 3, "pdb": {"minAvailable": "50%"}}, True),  # 2 of 3
        ({"autoscaling": {"enabled": True, "minReplicas": 1}, "pdb": {"minAvailable": "50%"}}, False),
    ],
)
def test_a_pdb_percentage_that_rounds_up_to_every_replica_fails_the_render(
    helm: HelmCall, gateway: dict[str, Any], ok: bool
) -> None:
    """Kubernetes rounds minAvailable's percentage up: 50 % of one replica is one, and the PDB
    then blocks every node drain."""
    answer = helm("render", {"gateway": _coalesce({"pdb": {"enabled": True}}, gateway)})
    assert answer["ok"] is ok, answer
    if not ok:
        assert "would block every eviction" in answer["error"]


def test_an_autoscaler_whose_minimum_is_above_its_maximum_fails_the_render(helm: HelmCall) -> None:
    values = {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}
    answer = helm("render", values)
    assert not answer["ok"] and "minReplicas (5) is above maxReplicas (2)" in answer["error"], answer


def test_simulated_engines_of_one_half_of_a_pair_alone_fail_the_render(helm: HelmCall) -> None:
    """simEngines.role prefill (or decode) with no other engine rendered a fleet the gateway
    refuses at start-up: pods crash-looping instead of a failed install."""
    for role in ("prefill", "decode"):
        answer = helm("render", _coalesce(_values("demo"), {"simEngines": {"role": role}}))
        assert not answer["ok"] and f"has {role} engines but no" in answer["error"], answer
    assert helm("render", _values("demo"))["ok"]
    # the other half must serve the same model: another model's pair is no help
    others = [
        {"url": f"http://elsewhere-{role}:8000", "model": "other-model", "role": role}
        for role in ("prefill", "decode")
    ]
    values = _coalesce(_values("demo"), {"simEngines": {"role": "prefill"}, "gateway": {"engines": others}})
    answer = helm("render", values)
    assert not answer["ok"] and 'model "qwen-7b" has prefill engines but no decode' in answer["error"], answer
    same = [{**others[1], "model": "qwen-7b"}]
    values = _coalesce(_values("demo"), {"simEngines": {"role": "prefill"}, "gateway": {"engines": same}})
    assert helm("render", values)["ok"]


# --- the replicas' shared state ---------------------------------------------------------------


def test_a_release_s_state_namespace_is_its_name_unless_set(helm: HelmCall) -> None:
    """Releases sharing one Redis database keep their keys apart; an upgrade from a chart without
    the setting may keep the old namespace for its rollout (docs/replicas.md)."""
    assert _gateway_env(_render(helm, {}))["SLOGATE_STATE_NAMESPACE"]["value"] == "rel-slogate"
    kept = _gateway_env(_render(helm, {"stateStore": {"namespace": "slogate"}}))
    assert kept["SLOGATE_STATE_NAMESPACE"]["value"] == "slogate"
    refused = helm("render", {"stateStore": {"namespace": "{bad}"}})  # (its braces: a hash tag's)
    assert not refused["ok"] and "schema" in refused["error"]


@pytest.mark.parametrize(
    ("gateway", "shared"),
    [
        ({}, True),  # the HPA may run 10
        ({"autoscaling": {"enabled": False}, "replicas": 2}, True),
        ({"autoscaling": {"enabled": False}, "replicas": 1}, False),
        ({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 1}}, False),
    ],
)
def test_replicas_share_their_load_through_the_charts_redis_when_there_may_be_several(
    helm: HelmCall, gateway: dict[str, Any], shared: bool
) -> None:
    docs = _render(helm, {"gateway": gateway})
    env = _gateway_env(docs)
    redis = _component(docs, "Deployment", "state-store")
    notes = " ".join(_notes(helm, {"gateway": gateway}).split())
    # (the notes said "no shared state yet" after the chart ran a Redis for the replicas)
    assert ("share their load on every engine" in notes) is shared and "no shared state" not in notes
    if not shared:
        assert not redis and "SLOGATE_STATE_STORE" not in env and "SLOGATE_REDIS_URL" not in env
        return
    (deploy,) = redis
    (service,) = _component(docs, "Service", "state-store")
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == deploy["spec"]["template"]["metadata"]["labels"]
    assert env["SLOGATE_STATE_STORE"]["value"] == "redis"
    # only clients with the password it made get in: any pod writing there could make every
    # engine look full to every replica
    (secret,) = _component(docs, "Secret", "state-store")
    password = secret["stringData"]["password"]
    assert len(password) == 32 and password.isalnum()
    redis_env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = {"name": secret["metadata"]["name"], "key": "password"}
    assert redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert redis_env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == ref
    # the password is on no command line (Kubernetes expands $(VAR) into the arguments, which
    # process lists and exec audits show): the server reads it on its input, the probe's client
    # from REDISCLI_AUTH
    for part in [*container["command"], *container["args"], *container["readinessProbe"]["exec"]["command"]]:
        assert "$(REDIS_PASSWORD)" not in part and " -a " not in part, part
    _serves_with_the_password_alone(container)
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    # (Kubernetes expands $(REDIS_PASSWORD), defined before it, in the URL)
    names = list(env)
    assert names.index("REDIS_PASSWORD") < names.index("SLOGATE_REDIS_URL")
    url = env["SLOGATE_REDIS_URL"]["value"]
    assert url == f"redis://:$(REDIS_PASSWORD)@{service['metadata']['name']}:6379/0"
    # each replica by its pod's name: a restarted pod is a new replica, a gone one expires
    assert env["SLOGATE_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # each release's keys apart from another's on the same Redis database
    assert env["SLOGATE_STATE_NAMESPACE"]["value"] == deploy["metadata"]["name"].removesuffix("-redis")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    # what the gateway reads from these, expanded, is a valid configuration
    expanded = url.replace("$(REDIS_PASSWORD)", password)
    settings = load_settings(engines=[], state_store="redis", redis_url=expanded)
    assert settings.redis_url == expanded


def test_an_external_redis_is_used_as_given(helm: HelmCall) -> None:
    docs = _render(helm, {"stateStore": {"redis": {"url": "redis://shared-redis.infra:6379/3"}}})
    assert not _component(docs, "Deployment", "state-store")
    assert _gateway_env(docs)["SLOGATE_REDIS_URL"]["value"] == "redis://shared-redis.infra:6379/3"
    docs = _render(helm, {"stateStore": {"redis": {"existingSecret": "redis-auth"}}})
    assert not _component(docs, "Deployment", "state-store")
    ref = _gateway_env(docs)["SLOGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "redis-auth", "key": "redis-url"}
    assert "REDIS_PASSWORD" not in _gateway_env(docs) and not _component(docs, "Secret", "state-store")
    # the chart's own Redis with a password kept outside the chart (helm template, GitOps)
    docs = _render(helm, {"stateStore": {"redis": {"passwordSecret": "redis-pass"}}})
    assert not _component(docs, "Secret", "state-store")
    (deploy,) = _component(docs, "Deployment", "state-store")
    assert deploy["spec"]["strategy"]["type"] == "Recreate" and not deploy["spec"]["strategy"].get(
        "rollingUpdate"
    )
    redis_env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = {"name": "redis-pass", "key": "password"}
    assert redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    assert _gateway_env(docs)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    docs = _render(helm, {"stateStore": {"mode": "memory"}})
    assert not _component(docs, "Deployment", "state-store") and "SLOGATE_STATE_STORE" not in _gateway_env(
        docs
    )


def _serves_with_the_password_alone(container: dict[str, Any]) -> None:
    """The chart's Redis command, run here with a password JSON and a shell would mangle: it
    serves only clients that give it, keeps the load keys past 64 MB, and nothing in the process
    list holds the password."""
    import subprocess
    import time as clock

    from gateway.state.local_redis import free_port
    from tests.support.redis_server import redis_server_path

    redis_server_path()  # (installed with apt-get when missing, as for the other Redis tests)
    port = free_port()
    password = 'p"w \\x'
    shell = container["command"] + [
        container["args"][0].replace("redis-server -", f"redis-server - --port {port} --bind 127.0.0.1")
    ]
    server = subprocess.Popen(shell, env={"PATH": os.environ["PATH"], "REDIS_PASSWORD": password})
    try:
        auth = {"PATH": os.environ["PATH"], "REDISCLI_AUTH": password}

        def cli(*args: str, env: dict[str, str] | None = None) -> str:
            done = subprocess.run(
                ["redis-cli", "-p", str(port), *args], env=env, capture_output=True, text=True
            )
            return done.stdout.strip()

        deadline = clock.monotonic() + 10
        while cli("ping", env=auth) != "PONG":
            assert clock.monotonic() < deadline and server.poll() is None, "the chart's Redis did not start"
            clock.sleep(0.05)
        assert cli("ping", env={"PATH": os.environ["PATH"]}).startswith("NOAUTH")
        # the shell execs the server: it is the container's PID 1 and gets the kubelet's SIGTERM
        # (behind a pipe the shell stayed PID 1, ignored it, and Redis waited for the SIGKILL)
        with open(f"/proc/{server.pid}/comm") as comm:
            assert comm.read().strip() == "redis-server"
        assert cli("config", "get", "maxmemory-policy", env=auth).split() == [
            "maxmemory-policy",
            "volatile-lru",
        ]
        listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert password not in listing
    finally:
        server.terminate()
        server.wait(10)


_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}


def _bytes(quantity: str) -> int:
    for suffix, factor in _QUANTITY.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)


@pytest.mark.parametrize("name", sorted(VALUES_FILES))
def test_the_gateway_s_memory_budgets_fit_its_pod(helm: HelmCall, tmp_path: Path, name: str) -> None:
    """The gateway's body budget defaulted to 1 GiB, the pod's whole limit (512 MiB in the demo):
    slow uploads got it OOM-killed, with every stream on it, before it answered a single 503. What
    it holds at once (bodies, prefix index) and 256 MiB for the rest must fit the limit."""
    docs = _render(helm, _values(name) | (PD_KEYS if name == "pd" else {}))
    settings = _gateway_config(docs, tmp_path)
    gateway = next(d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-slogate"))
    limit = _bytes(gateway["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"])
    held = settings.max_body_memory_bytes + settings.prefix_index_bytes
    assert held + (256 << 20) <= limit, (name, held, limit)


def test_a_setting_the_pod_cannot_satisfy_is_refused_at_render(helm: HelmCall) -> None:
    """engine_tokenizers names directories in the gateway's container: the pod mounts none, and
    the gateway refuses a directory it cannot read, so every pod crash-looped (an install served
    nothing, an upgrade stalled)."""
    answer = helm("render", {"gateway": {"config": {"engine_tokenizers": {"qwen-7b": "/models/qwen-7b"}}}})
    assert not answer["ok"], answer


def test_secret_keys_that_read_as_other_yaml_types_stay_strings(helm: HelmCall) -> None:
    """A Secret's key may be "0" or "true": written unquoted into the manifest it became a number
    or a bool, and the API server refused the Deployment. One the Secret cannot have is refused at
    render."""
    engine = {"url": "http://e:8000", "model": "m", "api_key_secret": {"name": "engine-keys", "key": "0"}}
    docs = _render(helm, {"gateway": {"engines": [engine]}})
    gateway = next(d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-slogate"))
    env = gateway["spec"]["template"]["spec"]["containers"][0]["env"]
    refs = [
        e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    ]
    assert {"name": "engine-keys", "key": "0"} in refs
    bad = {"url": "http://e:8000", "model": "m", "api_key_secret": {"name": "engine-keys", "key": "a: b"}}
    assert not helm("render", {"gateway": {"engines": [bad]}})["ok"]


def test_an_otlp_endpoint_with_credentials_is_refused(helm: HelmCall) -> None:
    """It is written to the ConfigMap: a user:password in it sat there in clear (engine URLs with
    one were refused already); the collector's credentials go in otlpHeaders, a Secret."""
    with_password = {"gateway": {"config": {"otlp_endpoint": "https://u:tok@collector:4318/v1/traces"}}}
    assert not helm("render", with_password)["ok"]
    assert helm("render", {"gateway": {"config": {"otlp_endpoint": "https://collector:4318/v1/traces"}}})[
        "ok"
    ]
