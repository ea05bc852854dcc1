"""Adapter ``scheduler-config-encoder-decoder``: SchedulerConfig(is_encoder_decoder=...)."""

from __future__ import annotations

from ..support import KeywordSignature
from ..unit import Adapter

# vLLM 0.11.2 added the InitVar, 0.12.0 made it required; speculators 0.3.0 never passes it,
# 0.4.x always does (so 0.4 on <= 0.11.0 must drop it).


SCHEDULER_CONFIG_KEYWORD = KeywordSignature(
    "SchedulerConfig",
    "is_encoder_decoder",
    lambda kw: False,
    missing="SchedulerConfig requires is_encoder_decoder; speculators does not pass it",
    unexpected="speculators passes is_encoder_decoder; this SchedulerConfig has no such field",
)


SCHEDULER_CONFIG_ENCODER_DECODER = Adapter(
    id="scheduler-config-encoder-decoder",
    patches=("speculators.data_generation.vllm_hidden_states_generator.SchedulerConfig",),
    how="keyword is_encoder_decoder",
    why="SchedulerConfig requires is_encoder_decoder (0.3.0 omits it) / lacks it (0.4 on <= 0.11.0)",
    vllm_change="0.11.2 added the InitVar, 0.12.0 made it required",
    detect="signature: is_encoder_decoder required / accepted vs AST: passed by speculators",
    delete_when="speculators 0.3.0 is no longer supported",
    side="driver",
    probe=SCHEDULER_CONFIG_KEYWORD.probe,
    apply=SCHEDULER_CONFIG_KEYWORD.apply,
)
