"""Scripts the tests run in fresh interpreters (``python tests/cells/cells/<name>.py ...``), not test modules.

A regular package so that ``tests/engine_cell.py`` (which stays beside ``engine_harness.py``, the
path that runs it) imports ``cells.cell_main`` from here and never a same-named module elsewhere.
"""
