"""docker-compose.yml and the Dockerfile read as data, so tests can run what they describe.

:func:`load_compose` reads the file with compose's variable interpolation applied (``${VAR}``,
``${VAR:-default}`` and the like, from the environment as ``docker compose`` would), and
:func:`load_services` turns each compose service into its command line (the image's ENTRYPOINT
plus the service's command), its environment (the image's ENV, then the service's) and its bind
mounts. :func:`localize` maps that onto this machine: every service on 127.0.0.1 at a port chosen
at run time, ``http://<service>:<port>`` addresses rewritten to match, and mounted files copied
with the same rewriting.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dockerfile
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"


@dataclass(frozen=True)
class Image:
    """The final stage of the Dockerfile: what every service built from it inherits."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: dict[str, str]
    user: str
    healthcheck: tuple[str, ...]
    base: str
    copies: tuple[str, ...]
    #: the extras of slogate the final stage installs (``slogate[a,b]`` in its RUN commands)
    extras: frozenset[str] = frozenset()


def read_dockerfile(path: Path = DOCKERFILE) -> Image:
    """The Dockerfile through BuildKit's own parser (the ``dockerfile`` package)."""
    stages: list[list[dockerfile.Command]] = []
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "FROM":
            stages.append([])
        stages[-1].append(command)
    final = stages[-1]
    env: dict[str, str] = {}
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    user = "root"
    healthcheck: tuple[str, ...] = ()
    for command in final:
        if command.cmd == "ENV":
            values = command.value
            env.update(zip(values[0::2], values[1::2], strict=True))
        elif command.cmd == "ENTRYPOINT":
            entrypoint = tuple(command.value) if command.json else ("/bin/sh", "-c", *command.value)
        elif command.cmd == "CMD":
            cmd = tuple(command.value)
        elif command.cmd == "USER":
            user = command.value[0]
        elif command.cmd == "HEALTHCHECK":
            kind, *rest = command.value
            if kind == "CMD":
                healthcheck = tuple(rest) if command.json else ("/bin/sh", "-c", *rest)
    copies = tuple(
        source
        for stage in stages
        for command in stage
        if command.cmd == "COPY" and not any(f.startswith("--from") for f in command.flags)
        for source in command.value[:-1]
    )
    base = final[0].value[0]
    extras = frozenset(
        extra.strip()
        for command in final
        if command.cmd == "RUN"
        for listed in re.findall(r"slogate\[([^\]]*)\]", " ".join(command.value))
        for extra in listed.split(",")
    )
    return Image(entrypoint, cmd, env, user, healthcheck, base, copies, extras)


@dataclass
class Service:
    name: str
    image: str
    built_here: bool
    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, Path]  # container path -> file in the repo
    depends_on: list[str]
    healthcheck: list[str]
    port: int | None = None  # the port the service listens on inside its container
    local_port: int | None = None
    local_argv: list[str] = field(default_factory=list)
    local_env: dict[str, str] = field(default_factory=dict)


def _listen_port(argv: list[str], env: dict[str, str]) -> int | None:
    for flag in ("--port",):
        if flag in argv:
            return int(argv[argv.index(flag) + 1])
    for arg in argv:
        match = re.match(r"--web\.listen-address=.*:(\d+)$", arg)
        if match:
            return int(match.group(1))
    if "SLOGATE_PORT" in env:
        return int(env["SLOGATE_PORT"])
    return None


def _command(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def _environment(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    return dict(item.split("=", 1) for item in value)


#: ``$$``, ``${NAME}``, ``${NAME-d}``, ``${NAME:-d}``, ``${NAME?e}``, ``${NAME:?e}``, ``$NAME``
_VARIABLE = re.compile(
    r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """``value`` with compose's variable syntax replaced in every string, as ``docker compose``
    does before anything else (a required variable that is missing raises ValueError)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        escaped, name, colon, kind, word, bare = match.groups()
        if escaped:
            return "$"
        name = name or bare
        current = env.get(name)
        unset = current is None or (colon == ":" and current == "")
        if kind == "-" and unset:
            return str(word)
        if kind == "?" and unset:
            raise ValueError(f"required variable {name} is missing: {word}")
        return current or ""

    return _VARIABLE.sub(one, value)


def load_compose(path: Path = COMPOSE_FILE, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as compose sees it: YAML merge keys (<<) resolved, variables from ``env``
    (this process's environment by default) interpolated."""
    data: dict[str, Any] = interpolate(yaml.safe_load(path.read_text()), os.environ if env is None else env)
    return data


def load_services(path: Path = COMPOSE_FILE, image: Image | None = None) -> dict[str, Service]:
    image = image or read_dockerfile()
    compose = load_compose(path)
    out: dict[str, Service] = {}
    built = {s.get("image") for s in compose["services"].values() if "build" in s}
    for name, spec in compose["services"].items():
        ours = "build" in spec or spec.get("image") in built
        command = _command(spec.get("command"))
        entrypoint = (
            _command(spec["entrypoint"]) if "entrypoint" in spec else list(image.entrypoint if ours else ())
        )
        env = {**(image.env if ours else {}), **_environment(spec.get("environment"))}
        mounts: dict[str, Path] = {}
        for volume in spec.get("volumes", []):
            source, target = str(volume).split(":")[:2]
            if source.startswith("."):
                mounts[target] = (path.parent / source).resolve()
        depends = spec.get("depends_on", [])
        health = spec.get("healthcheck", {}).get("test", [])
        health_argv = [str(v) for v in health[1:]] if health and health[0] == "CMD" else []
        if ours and not health_argv:
            health_argv = list(image.healthcheck)
        argv = [*entrypoint, *(command or (list(image.cmd) if ours else []))]
        out[name] = Service(
            name=name,
            image=str(spec.get("image", "")),
            built_here=ours,
            argv=argv,
            env=env,
            mounts=mounts,
            depends_on=list(depends),
            healthcheck=health_argv,
            port=_listen_port(argv, env),
        )
    return out


def start_order(services: dict[str, Service]) -> list[str]:
    """Services in dependency order (compose's depends_on)."""
    order: list[str] = []

    def visit(name: str, seen: tuple[str, ...] = ()) -> None:
        if name in order:
            return
        assert name not in seen, f"dependency cycle through {name}"
        for dep in services[name].depends_on:
            visit(dep, (*seen, name))
        order.append(name)

    for name in services:
        visit(name)
    return order


def localize(services: dict[str, Service], ports: dict[str, int], workdir: Path) -> None:
    """Fill ``local_argv`` / ``local_env``: the same processes on 127.0.0.1 at ``ports``.

    ``slogate`` (the image's entry point) becomes this interpreter running ``gateway.cli``;
    ``0.0.0.0`` becomes ``127.0.0.1``; every ``<service>:<container port>`` becomes
    ``127.0.0.1:<port>``; a mounted repo file named on the command line is replaced by a copy
    with the same rewriting.
    """
    addresses = {
        f"{name}:{svc.port}": f"127.0.0.1:{ports[name]}"
        for name, svc in services.items()
        if name in ports and svc.port
    }

    def rewrite(text: str) -> str:
        for old, new in addresses.items():
            text = re.sub(rf"(?<![\w.-]){re.escape(old)}(?!\d)", new, text)
        return text.replace("0.0.0.0", "127.0.0.1")

    for name, svc in services.items():
        if name not in ports:
            continue
        svc.local_port = ports[name]
        argv = [rewrite(a) for a in svc.argv]
        if argv and argv[0] == "slogate":
            argv = [sys.executable, "-m", "gateway.cli", *argv[1:]]
        if "--port" in argv:
            argv[argv.index("--port") + 1] = str(ports[name])
        for target, source in svc.mounts.items():
            copy = workdir / name / source.name
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(rewrite(source.read_text()))
            argv = [a.replace(target, str(copy)) for a in argv]
        env = {k: rewrite(v) for k, v in svc.env.items()}
        if "SLOGATE_PORT" in env:
            env["SLOGATE_PORT"] = str(ports[name])
        svc.local_argv = argv
        svc.local_env = env


def local_healthcheck(svc: Service) -> list[str]:
    """The service's healthcheck command as it runs on this machine (port rewritten)."""
    assert svc.port is not None and svc.local_port is not None
    argv = [a.replace(f"127.0.0.1:{svc.port}", f"127.0.0.1:{svc.local_port}") for a in svc.healthcheck]
    return [sys.executable if a == "python" else a for a in argv]
