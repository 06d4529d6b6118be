"""A short headless Locust run of loadtest/locustfile.py against ``slogate up`` (2 simulated engines).

Locust runs as its own process (it monkey-patches the standard library with gevent, which must not
happen inside pytest). The run must finish without a failed request, print the per-class SLO
attainment table, and write the JSON report with numbers for every class of the profile, the
targets being those the gateway assigned.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies.slo import parse_slo_profile
from profiles import PROFILES_DIR
from tests.deploy.compose_model import REPO
from tests.gateway.conftest import free_port

LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
RUN_TIME_S = 3


@pytest.fixture
def slogate_up(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = (tmp_path / "slogate-up.log").open("wb")  # the gateway's log lines, never a full pipe
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "up",
            "--port",
            str(port),
            "--engines",
            "2",
            "--time-scale",
            "10",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    assert proc.stdout is not None
    try:
        deadline = time.monotonic() + 60
        seen: list[str] = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if "slogate listening on" in line or not line:
                break
        assert "slogate listening on" in "".join(seen), "".join(seen)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()


def test_locust_reports_attainment_per_slo_class(slogate_up: str, tmp_path: Path) -> None:
    report = tmp_path / "slo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "--host",
            slogate_up,
            "--users",
            "4",
            "--spawn-rate",
            "4",
            "--run-time",
            f"{RUN_TIME_S}s",
            "--stop-timeout",
            "10",
            "--only-summary",
            "--slo-profile",
            "hyperflexis-4task",
            "--slo-report",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]  # Locust exits 1 when any request failed
    profile = parse_slo_profile((PROFILES_DIR / "slo" / "hyperflexis-4task.yaml").read_text())
    classes = [c for c in profile.classes if c != profile.default_class]

    assert "SLO attainment per class" in output, output[-4000:]
    for name in classes:
        row = re.search(rf"^{name}\s+(\d+)\s+(\d+)\s+(\d+\.\d)%", output, re.MULTILINE)
        assert row and int(row.group(1)) > 0, (name, output[-4000:])
        # Locust's own table has the class's TTFT and TPOT rows from the custom events
        assert re.search(rf"^TTFT\s+{name}\s+\d+", output, re.MULTILINE), name
        assert re.search(rf"^TPOT\s+{name}\s+\d+", output, re.MULTILINE), name

    rows = json.loads(report.read_text())
    assert list(rows) == classes
    for name, r in rows.items():
        assert r["requests"] > 0 and r["errors"] == 0, (name, r)
        assert r["met"] + r["missed_ttft"] + r["missed_tpot"] == r["requests"], (name, r)
        assert 0.0 <= r["attainment"] <= 1.0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"]
        assert r["tpot_p50_ms"] is not None and r["tpot_p50_ms"] > 0
        # the targets are the ones the gateway assigned (x-slo-*-ms headers): the profile's
        assert r["ttft_target_ms"] == pytest.approx(profile.classes[name].ttft_s * 1000)
        assert r["tpot_target_ms"] == pytest.approx(profile.classes[name].tpot_s * 1000)
