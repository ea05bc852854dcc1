"""Values tests/ and tools/ both use, defined once.

tools/ scripts import it as a sibling module; the tests get tools/ on ``sys.path`` from pytest's
``pythonpath`` (pyproject.toml). No imports: the GPU machine and other releases' venvs load it
with nothing installed.
"""

from __future__ import annotations

# Layer ids of the engine cells on the 4-layer tiny models, deliberately unsorted and not all of
# them: hidden_states[k] must be layer LAYER_IDS[k], and a missing layer must stay missing.
LAYER_IDS = (2, 0, 3)
# Every decoder layer of the 4-layer tiny models, deliberately unsorted (the GPU cells and the
# outlier report see every layer's input and output).
ALL_LAYER_IDS = (2, 0, 3, 1)
MAX_MODEL_LEN = 256
# The speculators releases the suite and the GPU cells run (tools/provision.sh installs them;
# 0.4.0 is byte-identical to 0.4.0.1 in data_generation, so only the matrix adds it).
TESTED_SPECULATORS = ("0.4.0.1", "0.3.0")
# The version matrix's columns (tools/matrix.py cells, tools/matrix_table.py tables).
MATRIX_SPECULATORS = ("0.4.0.1", "0.4.0", "0.3.0")
