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
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import yaml

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
    if dashboard.exists():  # written with the metrics work; when present it must be a dashboard
        data = json.loads(dashboard.read_text())
        assert data.get("panels"), "the provisioned dashboard has no panels"
