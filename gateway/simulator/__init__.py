"""The offline cluster simulator: the gateway's own dispatch core and the simulated engine's model,
driven by a virtual clock (see docs/architecture.md, "Offline cluster simulator")."""
