"""matplotlib for the experiment plots, headless, with a clear message when it is not installed."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend; exits with a hint if matplotlib is missing.

    Experiments call it before they start, so a missing plotting library does not surface only
    after minutes of replay.
    """
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "slogate: experiments write PNG plots and need matplotlib: pip install 'slogate[experiments]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
