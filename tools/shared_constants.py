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
# The one older release whose preflight cell the suite runs (tests/test_matrix_preflight.py); tools/provision.sh
# installs its matrix venv ahead, so the suite downloads nothing.
MATRIX_CI_RELEASE = "0.28.0"
# The version matrix's columns (tools/matrix.py cells, tools/matrix_table.py tables).
MATRIX_SPECULATORS = ("0.4.0.1", "0.4.0", "0.3.0")
# The GPU cells' model families (tests/tiny_models.py; tools/gpu_cells.py runs them, the GPU column
# of tools/matrix_table.py shows them): dense, top-k MoE, every expert routed, MLA + MoE, the
# Kimi-K2.5 wrapper, quantized.
GPU_FAMILIES = (
    "dense",
    "qwen3_moe",
    "qwen3_moe_all_experts",
    "deepseek_v3",
    "deepseek_v3_all_experts",
    "kimi_k25",
    "qwen3_moe_w4a16",
    "deepseek_v3_fp8",
    "deepseek_v3_fp8_w8a16",
)
