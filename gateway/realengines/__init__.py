"""Provisioning and launching of real inference engines (vLLM CPU build, llama.cpp) for local tests.

Everything heavy is cached outside the repo in ``~/.cache/slogate`` (override: ``SLOGATE_CACHE_DIR``).
See ``docs/real-engines.md``.
"""
