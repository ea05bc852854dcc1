"""Side ``import``: adapters applied before ``speculators`` is imported (driver and every worker).
One file per adapter, named after its id."""
