"""LoRA adapters on the sim engine over HTTP, as vLLM serves them: ``--lora-modules`` and the
runtime load/unload routes, ``/v1/models`` cards with the served model as ``parent``, requests
naming an adapter served (and answered under its name), others 404."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.sim.helpers import MODEL
from tests.support.sim_process import REPO_ROOT, SimProcess, start_sim_engine


@pytest.fixture(scope="module")
def lora_engine() -> Iterator[SimProcess]:
    args = ("--profile", "zero", "--model", MODEL, "--lora-modules", "a1=/adapters/a1", "a2=/adapters/a2")
    with start_sim_engine(*args) as proc:
        yield proc


def cards(engine: SimProcess) -> dict[str, tuple[str | None, str]]:
    data = httpx.get(engine.url + "/v1/models").json()["data"]
    return {c["id"]: (c["parent"], c["root"]) for c in data}


def chat(engine: SimProcess, model: str, path: str = "/v1/chat/completions") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(engine.url + path, json=body, timeout=10)


def test_lora_modules_are_listed_and_served(lora_engine: SimProcess) -> None:
    assert cards(lora_engine) == {
        MODEL: (None, MODEL),
        "a1": (MODEL, "/adapters/a1"),
        "a2": (MODEL, "/adapters/a2"),
    }
    r = chat(lora_engine, "a1")
    assert r.status_code == 200 and r.json()["model"] == "a1"
    r = httpx.post(
        lora_engine.url + "/v1/completions", json={"model": "a2", "prompt": "x", "max_tokens": 2}, timeout=10
    )
    assert r.status_code == 200 and r.json()["model"] == "a2"
    assert chat(lora_engine, MODEL).json()["model"] == MODEL
    r = chat(lora_engine, "nope")
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `nope` does not exist."


def test_adapters_load_and_unload_at_runtime(lora_engine: SimProcess) -> None:
    url = lora_engine.url
    assert chat(lora_engine, "b").status_code == 404
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/adapters/b"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully."
    assert cards(lora_engine)["b"] == (MODEL, "/adapters/b")
    assert chat(lora_engine, "b").status_code == 200
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/adapters/b"})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c"}).status_code == 400
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' removed successfully."
    assert "b" not in cards(lora_engine) and chat(lora_engine, "b").status_code == 404
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404


def test_a_bad_lora_module_is_refused_at_start() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.sim.cli", "--lora-modules", "no-path"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=60,
    )
    assert done.returncode == 2 and "name=path" in done.stderr
