"""The built-in status page: ``GET /dashboard`` and the JSON it polls (``state``), fed by the
recent-decision log (``decisions``) that the serving flow appends to."""
