"""Build llama.cpp's ``llama-server`` from source, once, and cache the binary.

The source is the llama.cpp copy vendored in the ``llama-cpp-python`` sdist on PyPI (the machine
reaches PyPI only). Layout under :func:`gateway.realengines._common.cache_dir`::

    downloads/llama_cpp_python-<v>.tar.gz   the sdist (``pip download --no-binary :all:``)
    build/llama-cpp-python-<v>/              unpacked source + cmake build tree
    bin/llama-server                         the cached static binary (~15 MB)
    bin/llama-server.ok                      marker (JSON: version, flags, build seconds)
    logs/llamacpp-build.log                  full cmake/compiler output

A cold build takes about 9 minutes on 2 cores (``-j2``, never more: the machine is shared).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
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

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# Exactly the flags known to work here; the prebuilt web UI would be downloaded from a hub: keep it off.
CMAKE_FLAGS: tuple[str, ...] = (
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
BUILD_JOBS = 2
_TOOLS = ("cmake", "make", "gcc", "g++")


def llama_server_path() -> Path:
    return cache_dir() / "bin" / "llama-server"


def _marker() -> Path:
    return cache_dir() / "bin" / "llama-server.ok"


def _spec() -> dict[str, object]:
    return {"llama-cpp-python": LLAMA_CPP_PYTHON_VERSION, "flags": list(CMAKE_FLAGS)}


def is_llama_server_ready() -> bool:
    try:
        recorded = json.loads(_marker().read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("spec") == _spec() and os.access(llama_server_path(), os.X_OK)


def ensure_llama_server(*, force: bool = False) -> Path:
    """Return the cached ``llama-server`` binary, building it first if needed. Idempotent."""
    if not force and is_llama_server_ready():
        return llama_server_path()
    with FileLock("llamacpp-build"):
        if force or not is_llama_server_ready():
            _build()
    return llama_server_path()


def _ensure_build_tools(log: Path) -> None:
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise ProvisionError(f"missing build tools {missing} and no apt-get to install them")
    progress(f"llama.cpp: installing build tools ({', '.join(missing)}) with apt-get")
    run_logged(["apt-get", "update"], log, what="apt-get update")
    run_logged(
        ["apt-get", "install", "-y", "--no-install-recommends", "cmake", "build-essential"],
        log,
        env={"DEBIAN_FRONTEND": "noninteractive"},
        what="apt-get install",
    )


def _download_sdist(log: Path) -> Path:
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    found = _find_sdist(downloads)
    if found is not None:
        return found
    progress(f"llama.cpp: downloading the llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist from PyPI")
    run_logged(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--progress-bar",
            "off",
            "-d",
            downloads,
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
        ],
        log,
        what="pip download",
    )
    found = _find_sdist(downloads)
    if found is None:
        raise ProvisionError(f"pip download left no llama-cpp-python sdist in {downloads}")
    return found


def _find_sdist(downloads: Path) -> Path | None:
    for pattern in (
        f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz",
        f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz",
    ):
        path = downloads / pattern
        if path.exists():
            return path
    return None


def _unpack_vendor(sdist: Path, dest: Path) -> Path:
    """Extract only ``vendor/llama.cpp`` from the sdist; return the llama.cpp source dir."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        tar.extractall(dest, members=members, filter="data")
    candidates = list(dest.glob("*/vendor/llama.cpp"))
    if not candidates or not (candidates[0] / "CMakeLists.txt").exists():
        raise ProvisionError(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt")
    return candidates[0]


def _build() -> None:
    log = logs_dir() / "llamacpp-build.log"
    started = time.monotonic()
    progress(f"llama.cpp: building llama-server (log in {log})")
    _ensure_build_tools(log)
    sdist = _download_sdist(log)
    work = cache_dir() / "build" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
    progress("llama.cpp: unpacking vendor/llama.cpp")
    src = _unpack_vendor(sdist, work)
    build_dir = src / "build"
    progress("llama.cpp: configuring with cmake")
    run_logged(["cmake", "-S", src, "-B", build_dir, *CMAKE_FLAGS], log, what="cmake configure")
    progress(f"llama.cpp: compiling target llama-server with -j{BUILD_JOBS} (about 9 min on 2 cores)")
    run_logged(
        ["cmake", "--build", build_dir, "--target", "llama-server", "-j", str(BUILD_JOBS)],
        log,
        what="cmake build",
    )
    built = next((p for p in build_dir.rglob("llama-server") if p.is_file() and os.access(p, os.X_OK)), None)
    if built is None:
        raise ProvisionError(f"the build finished but no llama-server binary was found under {build_dir}")
    target = llama_server_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(target)
    check = subprocess.run([target, "--version"], capture_output=True, text=True, check=False, timeout=60)
    version = (check.stdout + check.stderr).strip().splitlines()
    elapsed = time.monotonic() - started
    write_marker(
        _marker(),
        json.dumps({"spec": _spec(), "seconds": round(elapsed, 1), "version": version[:2]}),
    )
    # The source tree (~100 MB of objects) is not needed any more; the sdist stays for a rebuild.
    shutil.rmtree(work, ignore_errors=True)
    progress(f"llama.cpp: llama-server cached at {target} ({elapsed:.0f} s)")
