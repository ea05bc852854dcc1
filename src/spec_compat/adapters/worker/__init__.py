"""Side ``worker``: adapters of speculators' worker module (``custom_worker``), applied in the driver
(for fork) and in every vLLM worker (plugin). One file per adapter, named after its id."""
