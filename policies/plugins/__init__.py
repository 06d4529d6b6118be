"""Built-in routing plugins; importing this package registers them."""

from policies.plugins import load, pickers  # noqa: F401
