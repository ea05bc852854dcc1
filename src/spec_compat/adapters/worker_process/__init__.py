"""Side ``worker-process``: adapters of vLLM's worker classes, applied only inside the workers
spec_compat's executor starts. One file per adapter, named after its id."""
