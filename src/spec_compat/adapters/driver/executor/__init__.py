"""Driver-side adapters that are behaviours of spec_compat's executor subclass (``executor.py``):
each file (named after its adapter's id) defines one ``ExecutorHook`` its apply registers
(``executor.install_hook``). ``hooks.py`` (the hook protocol), ``entry.py``, ``fork.py`` and
``failures.py`` are the subclass's own parts."""
