"""A small parser for the Prometheus text format, for scraping engine ``/metrics``.

Scrapes run every second for every engine, and engines expose hundreds of histogram lines, so
this parser only splits lines whose metric name is wanted and skips the rest after a prefix test.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

Labels = dict[str, str]
Samples = dict[str, list[tuple[Labels, float]]]


#: a wanted line longer than this, with more labels than this, or past this many samples of its
#: name is skipped: no engine publishes such series, and a hostile one's 16 MB label value was
#: read a character at a time on the event loop (a second or more per scrape, every second)
MAX_LINE_CHARS = 64 * 1024
MAX_LABELS = 64
MAX_SAMPLES = 1024

_LABEL = re.compile(r'[\s,]*([^\s=,{}"]+)\s*=\s*"((?:[^"\\]|\\.)*)"')
_LABELS_END = re.compile(r"[\s,]*\}")


def _unescape(raw: str) -> str:
    """A label value's escapes (``\\``, ``\"``, ``\n``) undone, by C string methods."""
    return "\\".join(part.replace('\\"', '"').replace("\\n", "\n") for part in raw.split("\\\\"))


def _parse_labels(line: str, i: int) -> tuple[Labels, int] | None:
    """The label set that starts at ``line[i]`` (just past its ``{``) and the index just past
    its closing ``}``; None when it is malformed or has more than :data:`MAX_LABELS` labels (a
    ``}`` inside a quoted value, or an exemplar after the sample, is not where it ends)."""
    labels: Labels = {}
    for _ in range(MAX_LABELS + 1):
        end = _LABELS_END.match(line, i)
        if end is not None:
            return labels, end.end()
        pair = _LABEL.match(line, i)
        if pair is None:
            return None
        value = pair.group(2)
        labels[pair.group(1)] = _unescape(value) if "\\" in value else value
        i = pair.end()
    return None


def parse(text: str, wanted: Iterable[str]) -> Samples:
    """Samples of the wanted metric names: ``{name: [(labels, value), ...]}``.

    Names are matched exactly (so ``x_total`` and ``x`` are different names). Malformed lines,
    lines past the bounds above and NaN values are skipped rather than failing the whole scrape.
    """
    wanted_set = set(wanted)
    out: Samples = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:
            name = line[:brace]
            if name not in wanted_set or len(line) > MAX_LINE_CHARS or len(out.get(name, ())) >= MAX_SAMPLES:
                continue
            parsed = _parse_labels(line, brace + 1)
            if parsed is None:
                continue
            labels, end = parsed
            rest = line[end:].split()
        else:
            name = line[:space]
            if name not in wanted_set or len(line) > MAX_LINE_CHARS or len(out.get(name, ())) >= MAX_SAMPLES:
                continue
            labels = {}
            rest = line[space + 1 :].split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if not math.isfinite(value):  # NaN, +Inf, -Inf: no count or share an engine can have
            continue
        out.setdefault(name, []).append((labels, value))
    return out


def total(samples: Samples, *names: str) -> float | None:
    """Sum over all label sets of the first name present (names in order of preference)."""
    for name in names:
        if name in samples:
            return sum(v for _, v in samples[name])
    return None
