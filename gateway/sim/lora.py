"""LoRA adapters on the simulated engine, as vLLM serves them (behaviour: the base model's).

Adapters come from ``--lora-modules name=path ...`` at start-up and from vLLM's runtime routes
(``POST /v1/load_lora_adapter {lora_name, lora_path}``, ``POST /v1/unload_lora_adapter
{lora_name}``; vLLM needs ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` for them,
the sim always takes them). ``/v1/models`` lists each adapter as its own model card whose
``parent`` is the served model and ``root`` the adapter's path; a request whose ``model`` names a
loaded adapter is served like one for the base model, and its answer names the adapter. What is
not modelled: an adapter's own weights (same output and timing as the base model), its KV blocks
kept apart from the base model's (vLLM hashes them with the adapter's name; the sim's prefix cache
shares them), ``max_loras`` and the load time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
from aiohttp import web

from gateway.api.errors import described
from gateway.sim.responses import error_body


def parse_lora_modules(values: Iterable[str]) -> dict[str, str]:
    """``name=path`` items (vLLM's ``--lora-modules`` plain form) as name -> path; raises
    ValueError naming the bad item."""
    modules: dict[str, str] = {}
    for item in values:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path items, got {item!r}")
        modules[name] = path
    return modules


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(
        status=status, body=error_body(status, message, param), content_type="application/json"
    )


async def _fields(http: web.Request) -> dict[str, Any] | web.Response:
    try:
        body = orjson.loads(await http.read() or b"{}")
    except orjson.JSONDecodeError as exc:
        return _error(400, f"invalid JSON: {exc}")
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object")
    return body


class LoraAdapters:
    """The adapters loaded on one engine's model (name -> path) and the routes that change them."""

    def __init__(self, model: str, modules: dict[str, str] | None = None) -> None:
        self.model = model
        self.loaded: dict[str, str] = dict(modules or {})

    def serves(self, name: object) -> bool:
        """Whether a request's ``model`` is this engine's: its model or a loaded adapter."""
        return name == self.model or (isinstance(name, str) and name in self.loaded)

    def cards(self, created: int) -> list[dict[str, Any]]:
        """The adapters' ``/v1/models`` cards, as vLLM shows them (no ``max_model_len``)."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": self.model,
                "max_model_len": None,
                "permission": [],
            }
            for name, path in self.loaded.items()
        ]

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, http: web.Request) -> web.Response:
        body = await _fields(http)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.model:
            return _error(400, f"The lora adapter '{name}' has the served model's name.", "lora_name")
        if name in self.loaded and not body.get("load_inplace"):
            return _error(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        self.loaded[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, http: web.Request) -> web.Response:
        body = await _fields(http)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        if not isinstance(name, str):
            return _error(400, f"lora_name must be a string, got {described(name)}", "lora_name")
        if name not in self.loaded:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        del self.loaded[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
