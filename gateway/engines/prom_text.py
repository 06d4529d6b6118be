"""A small parser for the Prometheus text format, for scraping engine ``/metrics``.

Scrapes run every second for every engine, and engines expose hundreds of histogram lines, so
this parser only splits lines whose metric name is wanted and skips the rest after a prefix test.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

Labels = dict[str, str]
Samples = dict[str, list[tuple[Labels, float]]]


def _parse_labels(text: str) -> Labels:
    labels: Labels = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip().lstrip(",").strip()
        j = eq + 1
        if j >= n or text[j] != '"':
            break
        j += 1
        chars: list[str] = []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                nxt = text[j + 1]
                chars.append("\n" if nxt == "n" else nxt)
                j += 2
                continue
            chars.append(text[j])
            j += 1
        labels[key] = "".join(chars)
        i = j + 1
    return labels


def parse(text: str, wanted: Iterable[str]) -> Samples:
    """Samples of the wanted metric names: ``{name: [(labels, value), ...]}``.

    Names are matched exactly (so ``x_total`` and ``x`` are different names). Malformed lines
    and NaN values are skipped rather than failing the whole scrape.
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
            if name not in wanted_set:
                continue
            close = line.rfind("}")
            if close < brace:
                continue
            labels = _parse_labels(line[brace + 1 : close])
            rest = line[close + 1 :].split()
        else:
            name = line[:space]
            if name not in wanted_set:
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
