"""docker-compose.yml, the Dockerfile and the Prometheus / Grafana files, checked without Docker.

- the compose file against the compose specification's JSON schema (the one compiled into the
  official ``docker-compose`` v2 binary) and through ``docker-compose config`` itself, which
  parses, interpolates and normalises it with no daemon;
- the Dockerfile through BuildKit's parser: base image, non-root user, health check, entry point,
  and sources that exist and are not excluded by .dockerignore;
- Prometheus' configuration with ``promtool check config``;
- Grafana's provisioning files against the compose file's mounts and services.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from gateway.server import SHUTDOWN_BACKSTOP_S
from gateway.settings import load_settings
from tests.deploy.compose_model import COMPOSE_FILE, REPO, load_compose, load_services, read_dockerfile


def _schema_errors(schema: dict[str, Any], document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_compose_file_satisfies_compose_spec_schema(compose_schema: dict[str, Any]) -> None:
    compose = load_compose()
    assert _schema_errors(compose_schema, compose) == []
    # the schema is strict enough to catch a typo and a wrong shape
    broken = copy.deepcopy(compose)
    broken["services"]["gateway"]["healthcheck"] = {"tset": ["CMD", "true"]}
    broken["services"]["sim-0"]["ports"] = {"8001": 8001}
    errors = _schema_errors(compose_schema, broken)
    assert any(e.startswith("services/gateway/healthcheck") for e in errors), errors
    assert any(e.startswith("services/sim-0/ports") for e in errors), errors


def test_docker_compose_config_accepts_the_file(compose_bin: Path, tmp_path: Path) -> None:
    """The real compose implementation normalises the file to the commands the process test runs."""
    proc = subprocess.run(
        [str(compose_bin), "-f", str(COMPOSE_FILE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    normalised = json.loads(proc.stdout)["services"]
    ours = load_services()
    assert set(normalised) == set(ours)
    raw = load_compose()["services"]
    for name, svc in ours.items():
        # compose resolves the file's YAML anchors and merge keys as the tests' own reading does
        assert normalised[name].get("command") == raw[name].get("command"), name
        for key, value in (normalised[name].get("environment") or {}).items():
            assert svc.env[key] == value, (name, key)
        assert normalised[name].get("healthcheck", {}).get("test") == raw[name].get("healthcheck", {}).get(
            "test"
        )
    # and it refuses a broken file (a dependency on a service that does not exist)
    broken = load_compose()
    broken["services"]["gateway"]["depends_on"]["sim-9"] = {"condition": "service_healthy"}
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(broken))
    proc = subprocess.run(
        [str(compose_bin), "-f", str(bad), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0 and "sim-9" in proc.stderr, proc.stderr


def test_dockerfile_builds_a_slim_non_root_image_with_a_healthcheck() -> None:
    image = read_dockerfile()
    assert image.base == "python:3.11-slim"
    assert image.user.split(":")[0] not in ("", "0", "root")
    assert image.entrypoint == ("slogate",)
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["slogate"] == "gateway.cli:main"
    assert image.cmd[0] == "serve"
    assert image.healthcheck and "/health" in " ".join(image.healthcheck)
    # every source copied into the build exists and is not excluded by .dockerignore
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for source in image.copies:
        assert (REPO / source).exists(), source
        assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), source
    for package in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
        "find"
    ]["include"]:
        assert package.rstrip("*") in image.copies, f"package {package} is not copied into the image"


def test_the_image_serves_every_setting_the_chart_offers() -> None:
    # a deployment may set an OTLP endpoint (the chart) and engine tokenizers (compose, which can
    # mount a tokenizer directory; the chart mounts none): the image must carry what they load
    # (an image without them failed at start-up, or exported no traces)
    image = read_dockerfile()
    chart = json.loads((REPO / "helm" / "slogate" / "values.schema.json").read_text())
    assert "otlp_endpoint" in json.dumps(chart)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("hf-tokenizer", "otlp"):
        assert extra in extras
        assert extra in image.extras, f"the image does not install slogate[{extra}]"


def test_compose_gateway_settings_load() -> None:
    """The gateway's config file in the compose setup is valid for the gateway's settings code, and
    names exactly the compose file's engine services."""
    services = load_services()
    gateway = services["gateway"]
    config_target = gateway.argv[gateway.argv.index("--config") + 1]
    settings = load_settings(gateway.mounts[config_target])
    engines = {e.engine_id: e for e in settings.engines}
    sims = {n for n, s in services.items() if s.argv[1:2] == ["sim-engine"]}
    assert set(engines) == sims == set(gateway.depends_on)
    for name, engine in engines.items():
        assert engine.base_url == f"http://{name}:{services[name].port}"
        assert engine.kind == "sim"
    # listening on 0.0.0.0 in its container, published on 127.0.0.1: browsers are answered on
    # this machine's names and the service's only (DNS rebinding), which names it to check
    from gateway.api.host_check import HostCheck

    check = HostCheck(settings.host if settings.host != "127.0.0.1" else "0.0.0.0", settings.allowed_hosts)
    browser = [(b"sec-fetch-site", b"same-origin")]
    assert check.refusal([(b"host", b"attacker.example:8000"), *browser]) is not None
    assert check.refusal([(b"host", b"localhost:8000"), *browser]) is None


def test_compose_waits_for_the_gateways_shutdown_grace() -> None:
    """``docker compose stop`` kills after ``stop_grace_period`` (10 s unless set): the gateway's
    own grace, and uvicorn's backstop after it, must end first."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    period = compose["services"]["gateway"]["stop_grace_period"]
    assert period.endswith("s") and period[:-1].isdigit(), period
    gateway = load_services()["gateway"]
    settings = load_settings(gateway.mounts[gateway.argv[gateway.argv.index("--config") + 1]])
    assert settings.shutdown_grace_s + SHUTDOWN_BACKSTOP_S < int(period[:-1])


def test_prometheus_config_is_valid_and_scrapes_every_slogate_service(prometheus_bin: Path) -> None:
    compose = load_compose()
    prom = compose["services"]["prometheus"]
    source = next(v.split(":")[0] for v in prom["volumes"] if "prometheus.yml" in v)
    path = (REPO / source).resolve()
    proc = subprocess.run(
        [str(prometheus_bin / "promtool"), "check", "config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load(path.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    services = load_services()
    expected = {f"{n}:{s.port}" for n, s in services.items() if s.built_here}
    assert targets == expected


def test_grafana_provisioning_matches_compose() -> None:
    compose = load_compose()
    grafana = compose["services"]["grafana"]
    mounts = dict(reversed(v.split(":")[:2]) for v in grafana["volumes"])
    provisioning = (REPO / mounts["/etc/grafana/provisioning"]).resolve()
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    prom_port = compose["services"]["prometheus"]["ports"][0].split(":")[-1]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{prom_port}"
    assert source["isDefault"] is True
    providers = yaml.safe_load((provisioning / "dashboards" / "slogate.yaml").read_text())
    (provider,) = providers["providers"]
    dashboards_dir = provider["options"]["path"]
    assert dashboards_dir in mounts, f"{dashboards_dir} is not mounted into Grafana"
    assert (REPO / mounts[dashboards_dir]).resolve() == REPO / "deploy" / "grafana"
    dashboard = REPO / "deploy" / "grafana" / "slogate-dashboard.json"
    data = json.loads(dashboard.read_text())
    assert data.get("panels"), "the provisioned dashboard has no panels"


def _compose_config(compose_bin: Path, **env: str) -> dict[str, Any]:
    """``docker-compose config`` of the repo's file with only ``env`` among compose's variables."""
    base = {k: v for k, v in os.environ.items() if k not in ("SLOGATE_BIND", "GRAFANA_ADMIN_PASSWORD")}
    proc = subprocess.run(
        [str(compose_bin), "-f", str(COMPOSE_FILE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**base, **env},
    )
    assert proc.returncode == 0, proc.stderr
    services: dict[str, Any] = json.loads(proc.stdout)["services"]
    return services


def test_published_ports_listen_on_localhost_by_default(compose_bin: Path) -> None:
    """Gateway (no keys by default), Prometheus and Grafana are reachable from this host only,
    unless SLOGATE_BIND says otherwise."""
    published = {name: svc.get("ports", []) for name, svc in load_compose(env={})["services"].items()}
    assert {name for name, ports in published.items() if ports} == {"gateway", "prometheus", "grafana"}
    assert all(str(p).startswith("127.0.0.1:") for ports in published.values() for p in ports), published
    for bind in ("127.0.0.1", "0.0.0.0"):
        services = _compose_config(compose_bin, **({} if bind == "127.0.0.1" else {"SLOGATE_BIND": bind}))
        hosts = {p["host_ip"] for svc in services.values() for p in svc.get("ports", [])}
        assert hosts == {bind}, (bind, services)


def test_grafana_admin_password_comes_from_the_environment(compose_bin: Path) -> None:
    default = _compose_config(compose_bin)["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert default == "insecure-default-change-me"
    text = COMPOSE_FILE.read_text()
    assert "WARNING: without GRAFANA_ADMIN_PASSWORD set" in text  # the default says what it is
    chosen = _compose_config(compose_bin, GRAFANA_ADMIN_PASSWORD="a-real-secret")
    assert chosen["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "a-real-secret"


def test_compose_has_a_commented_tracing_example() -> None:
    """The commented lines, uncommented, make a valid gateway tracing setup and a Jaeger service."""
    found = re.findall(
        r"^\s*# (SLOGATE_TRACING|SLOGATE_OTLP_ENDPOINT): (.+)$", COMPOSE_FILE.read_text(), re.M
    )
    tracing = {name: value.strip('"') for name, value in found}
    settings = load_settings(
        tracing=tracing["SLOGATE_TRACING"] == "true", otlp_endpoint=tracing["SLOGATE_OTLP_ENDPOINT"]
    )
    assert settings.tracing and settings.otlp_endpoint == "http://jaeger:4318/v1/traces"
    assert "#   image: jaegertracing/all-in-one" in COMPOSE_FILE.read_text()
