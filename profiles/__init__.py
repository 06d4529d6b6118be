"""Declarative YAML shipped with slogate: ``engines/`` (latency and capacity), ``routing/``, ``slo/``.

A package only so that a non-editable install carries the files; nothing here is imported for code.
"""

from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent
