"""Scripts the tests run in fresh interpreters (``python tests/cells/<name>.py ...``), not test modules.

Each runs with this folder as ``sys.path[0]``, so the scripts import their shared helpers
(``cell_main``, ``outcomes``) as siblings; a regular package so that tests can also import them
as ``cells.<name>``.
"""
