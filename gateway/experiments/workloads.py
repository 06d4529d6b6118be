"""Named workloads: YAML files in ``loadtest/workloads/``, their schema, and :func:`load_workload`.

A name resolves to ``loadtest/workloads/<name>.yaml`` of the repository holding this package
(or, failing that, of the current directory or one above it); a path is read as given. The file
holds the tasks, the arrival process and the workload's shape; the caller gives the rate, the
size and the seed. Schema (``?`` optional, default after ``=``)::

    name?: str = file stem
    description?: str
    kind?: mix | ramp | multi-turn = mix
    arrivals?:                       # = {process: poisson}
      process: poisson | gamma | trace
      cv: float > 0                  # gamma only: std/mean of the gaps (> 1 is bursty)
      path: str                      # trace only: relative to this file
      rescale?: bool = true          # trace only: scale the gaps to the caller's qps
    max_prompt_tokens?: int = 3500   # default ``max`` of every ``input`` distribution
    max_output_tokens?: int = 1500   # default ``max`` of every ``output`` distribution
    defaults?: {requests?: int, duration_s?: float}   # when the caller gives neither
    tasks:                           # one or more
      - name: str
        slo: {ttft_s: float, tpot_s: float}
        priority?: int = 0           # 0 is the highest
        weight?: float = 1           # share of a mix's arrivals / chance a session is this task
        prefix_tokens?: int = 0      # shared prefix of every prompt (not in multi-turn)
        input: <length>              # the prompt (multi-turn: one user message)
        output: <length>
    ramp: {join_every_s: float}      # kind: ramp only
    session:                         # kind: multi-turn only
      turns: <length>
      think_time_s: float            # mean of the exponential gap between turns
      system_tokens?: <length> = 0
      system_prompts?: int = 1       # distinct system prompts the sessions pick from
      max_prompt_tokens?: int = 8192 # a session ends before a turn that would exceed it

    <length>: an int (always that), or {dist: ..., min?: int = 1, max?: int, ...} with
      fixed {value} | uniform {low, high} | normal {mean, std}
      | lognormal {median, sigma} or {mean, std} | pareto {scale, alpha}

Every error is a ValueError naming the file and the field (``tasks[1].input.std``); unknown
fields are errors too, so a misspelt key cannot silently fall back to a default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import yaml

from gateway.experiments.arrivals import ArrivalProcess, Gamma, Poisson, Trace
from gateway.experiments.generators import KINDS, Kind, Sessions, Task, Workload
from gateway.experiments.lengths import Fixed, LengthDist, LogNormal, Normal, Pareto, Uniform
from gateway.experiments.workload import RequestSpec

_SUBDIR = Path("loadtest") / "workloads"
_DISTS = ("fixed", "uniform", "normal", "lognormal", "pareto")
_PROCESSES = ("poisson", "gamma", "trace")


def workloads_dir() -> Path:
    """``loadtest/workloads`` of the repository this package is in (an editable install or a
    checkout on ``sys.path``), else of the current directory or the nearest one above it."""
    here = Path(__file__).resolve()
    cwd = Path.cwd().resolve()
    for base in (*here.parents, cwd, *cwd.parents):
        candidate = base / _SUBDIR
        if candidate.is_dir():
            return candidate
    raise ValueError(f"cannot find {_SUBDIR} above {here.parent} or {cwd}")


def list_workloads() -> list[str]:
    """Names of the workloads shipped in :func:`workloads_dir`."""
    return sorted(p.stem for p in workloads_dir().glob("*.yaml"))


def resolve_workload(name_or_path: str) -> Path:
    """The YAML file of a workload name, or the path itself when given one."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        if not path.is_file():
            raise ValueError(f"workload file {path} does not exist")
        return path
    candidate = workloads_dir() / f"{name_or_path}.yaml"
    if not candidate.is_file():
        known = ", ".join(list_workloads())
        raise ValueError(f"unknown workload {name_or_path!r} (known: {known}; or give a .yaml path)")
    return candidate


def read_workload(name_or_path: str) -> Workload:
    """Parse a workload file (by name or path) into a :class:`Workload`."""
    path = resolve_workload(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    return parse_workload(data, source=str(path), base_dir=path.parent, name=path.stem)


def load_workload(
    name_or_path: str,
    *,
    qps: float,
    requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
) -> list[RequestSpec]:
    """The requests of a named (or YAML-file) workload, sorted by arrival time.

    ``qps`` is the mean total request rate (a ramp's once every client has joined; a multi-turn
    workload's counted in turns); ``requests`` and/or ``duration_s`` bound it (whichever ends
    first; the file's ``defaults`` when neither is given). Same arguments, same requests.
    """
    return read_workload(name_or_path).generate(qps=qps, requests=requests, duration_s=duration_s, seed=seed)


class _Fields:
    """A mapping read field by field, every error prefixed with the file and the field's path."""

    def __init__(self, data: object, source: str, where: str) -> None:
        self.source = source
        self.where = where
        if not isinstance(data, dict):
            raise self.error(None, f"expected a mapping, got {_kind_of(data)}")
        self.data: dict[object, object] = data
        self.read: set[str] = set()
        #: fields asked about but not (yet) read, so an error can list every field known here
        self.known: set[str] = set()

    def path(self, key: str | None) -> str:
        if key is None:
            return self.where or "top level"
        return f"{self.where}.{key}" if self.where else key

    def error(self, key: str | None, message: str) -> ValueError:
        return ValueError(f"{self.source}: {self.path(key)}: {message}")

    def has(self, key: str) -> bool:
        self.known.add(key)
        return key in self.data

    def get(self, key: str) -> object:
        self.read.add(key)
        if key not in self.data:
            raise self.error(key, "missing (required)")
        return self.data[key]

    def number(
        self,
        key: str,
        default: float | None = None,
        *,
        above: float | None = None,
        minimum: float = -math.inf,
    ) -> float:
        if default is not None and key not in self.data:
            self.read.add(key)
            return default
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.error(key, f"expected a number, got {value!r}")
        if above is not None and not value > above:
            raise self.error(key, f"must be > {above:g}, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be >= {minimum:g}, got {value!r}")
        return float(value)

    def integer(self, key: str, default: int | None = None, *, minimum: int = 0) -> int:
        if default is not None and key not in self.data:
            self.read.add(key)
            return default
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value!r}")
        return value

    def text(self, key: str, default: str | None = None, choices: Sequence[str] = ()) -> str:
        if default is not None and key not in self.data:
            self.read.add(key)
            return default
        value = self.get(key)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {value!r}")
        if choices and value not in choices:
            raise self.error(key, f"expected one of {', '.join(choices)}; got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        if key not in self.data:
            self.read.add(key)
            return default
        value = self.get(key)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def child(self, key: str) -> _Fields:
        return _Fields(self.get(key), self.source, self.path(key))

    def children(self, key: str) -> list[_Fields]:
        value = self.get(key)
        if not isinstance(value, list) or not value:
            raise self.error(key, f"expected a non-empty list, got {_kind_of(value)}")
        return [_Fields(item, self.source, f"{self.path(key)}[{i}]") for i, item in enumerate(value)]

    def close(self) -> None:
        unknown = sorted(str(k) for k in self.data if k not in self.read)
        if unknown:
            expected = ", ".join(sorted(self.read | self.known))
            raise self.error(unknown[0], f"unexpected field (expected here: {expected})")


def _kind_of(value: object) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"[:80]


def parse_workload(data: object, *, source: str, base_dir: Path, name: str) -> Workload:
    """A workload from already-loaded YAML; ``base_dir`` is where relative trace paths start."""
    top = _Fields(data, source, "")
    kind_name = top.text("kind", "mix", KINDS)
    kind: Kind = next(k for k in KINDS if k == kind_name)
    max_prompt = top.integer("max_prompt_tokens", 3500, minimum=1)
    max_output = top.integer("max_output_tokens", 1500, minimum=1)
    tasks = tuple(_task(f, max_prompt, max_output) for f in top.children("tasks"))
    seen: set[str] = set()
    for i, task in enumerate(tasks):
        if task.name in seen:
            raise ValueError(f"{source}: tasks[{i}].name: duplicate task name {task.name!r}")
        seen.add(task.name)

    join_every_s = 0.0
    if kind == "ramp":
        ramp = top.child("ramp")
        join_every_s = ramp.number("join_every_s", minimum=0.0)
        ramp.close()
    elif top.has("ramp"):
        raise top.error("ramp", "only for kind: ramp")

    sessions = None
    if kind == "multi-turn":
        sessions = _sessions(top.child("session"))
        for i, task in enumerate(tasks):
            if task.prefix_tokens:
                raise top.error(f"tasks[{i}].prefix_tokens", "not for multi-turn (use session.system_tokens)")
    elif top.has("session"):
        raise top.error("session", "only for kind: multi-turn")

    requests: int | None = None
    duration_s: float | None = None
    if top.has("defaults"):
        defaults = top.child("defaults")
        if defaults.has("requests"):
            requests = defaults.integer("requests", minimum=1)
        if defaults.has("duration_s"):
            duration_s = defaults.number("duration_s", above=0.0)
        defaults.close()

    workload = Workload(
        name=top.text("name", name),
        tasks=tasks,
        arrivals=_arrivals(top.child("arrivals"), base_dir) if top.has("arrivals") else Poisson(),
        kind=kind,
        join_every_s=join_every_s,
        sessions=sessions,
        requests=requests,
        duration_s=duration_s,
        description=top.text("description", ""),
    )
    top.close()
    return workload


def _task(f: _Fields, max_prompt: int, max_output: int) -> Task:
    slo = f.child("slo")
    task = Task(
        name=f.text("name"),
        ttft_s=slo.number("ttft_s", above=0.0),
        tpot_s=slo.number("tpot_s", above=0.0),
        input=_length(f, "input", hi=max_prompt),
        output=_length(f, "output", hi=max_output),
        priority=f.integer("priority", 0),
        weight=f.number("weight", 1.0, above=0.0),
        prefix_tokens=f.integer("prefix_tokens", 0),
    )
    slo.close()
    f.close()
    return task


def _length(parent: _Fields, key: str, *, hi: int, lo: int = 1) -> LengthDist:
    raw = parent.get(key)
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < lo:
            raise parent.error(key, f"must be >= {lo}, got {raw}")
        return Fixed(raw, lo=lo, hi=max(raw, hi))
    f = parent.child(key)
    dist = f.text("dist", choices=_DISTS)
    lo = f.integer("min", lo)
    hi = f.integer("max", max(hi, lo), minimum=lo)
    length: LengthDist
    if dist == "fixed":
        length = Fixed(f.integer("value", minimum=lo), lo, hi)
    elif dist == "uniform":
        low = f.integer("low", minimum=lo)
        length = Uniform(low, f.integer("high", minimum=low), lo, hi)
    elif dist == "normal":
        length = Normal(f.number("mean"), f.number("std", minimum=0.0), lo, hi)
    elif dist == "lognormal":
        if f.has("median") or not f.has("mean"):
            length = LogNormal(f.number("median", above=0.0), f.number("sigma", minimum=0.0), lo, hi)
        else:
            mean = f.number("mean", above=0.0)
            length = LogNormal.from_mean_std(mean, f.number("std", minimum=0.0), lo, hi)
    else:
        length = Pareto(f.number("scale", above=0.0), f.number("alpha", above=0.0), lo, hi)
    f.close()
    return length


def _arrivals(f: _Fields, base_dir: Path) -> ArrivalProcess:
    process = f.text("process", choices=_PROCESSES)
    arrivals: ArrivalProcess
    if process == "poisson":
        arrivals = Poisson()
    elif process == "gamma":
        arrivals = Gamma(f.number("cv", above=0.0))
    else:
        path = base_dir / f.text("path")
        try:
            arrivals = Trace.from_file(path, f.boolean("rescale", True))
        except ValueError as exc:
            raise f.error("path", str(exc)) from None
    f.close()
    return arrivals


def _sessions(f: _Fields) -> Sessions:
    max_prompt = f.integer("max_prompt_tokens", 8192, minimum=2)
    system_tokens = _length(f, "system_tokens", hi=max_prompt - 1, lo=0) if f.has("system_tokens") else None
    if system_tokens is not None and system_tokens.hi >= max_prompt:
        raise f.error("system_tokens", f"max must be below max_prompt_tokens ({max_prompt})")
    sessions = Sessions(
        turns=_length(f, "turns", hi=1000),
        think_time_s=f.number("think_time_s", above=0.0),
        system_tokens=system_tokens if system_tokens is not None else Fixed(0, lo=0, hi=0),
        system_prompts=f.integer("system_prompts", 1, minimum=1),
        max_prompt_tokens=max_prompt,
    )
    f.close()
    return sessions
