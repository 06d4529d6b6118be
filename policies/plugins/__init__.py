"""Built-in routing plugins; importing this package registers them."""

from policies.plugins import affinity, cache_aware, gimbal, load, lora, peers, pickers  # noqa: F401
