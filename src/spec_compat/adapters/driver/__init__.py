"""Side ``driver``: adapters of speculators' generator module, applied in the driver only. One file
per adapter, named after its id; the executor's behaviours are in ``driver/executor/``."""
