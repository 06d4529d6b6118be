"""Run the gateway under uvicorn with httptools and uvloop (the fast pairing on this hardware)."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.logs import setup_logging
from gateway.settings import Settings


def uvicorn_config(settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        http="httptools",
        loop="uvloop",
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=30,
        backlog=4096,
    )


def serve(settings: Settings) -> None:
    """Blocks until SIGINT/SIGTERM; uvicorn drains connections and runs the lifespan shutdown."""
    setup_logging(settings.log_level)
    uvicorn.Server(uvicorn_config(settings)).run()
