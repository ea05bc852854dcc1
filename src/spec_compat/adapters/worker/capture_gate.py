"""Adapter ``capture-gate``: supports_eagle3 refusal (speculators 0.3.0)."""

from __future__ import annotations

import functools
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..speculators_code import worker_module
from ..support import base_model
from ..unit import SPECULATORS_0_3_ONLY, Adapter

# 0.3.0 refuses any model that does not declare vLLM's SupportsEagle3 interface (Mixtral never
# does, Qwen3-MoE only from 0.11.2, DeepSeek-V2/V3 from 0.18.1) although its capture only needs a
# base model with `layers`: which is what 0.4.x checks instead.


def probe_capture_gate(ctx: Context) -> Probe:
    if "supports_eagle3" in vars(worker_module(ctx)):
        return Probe(True, "speculators gates capture on vLLM's SupportsEagle3 interface")
    return Probe(False, "speculators does not gate on SupportsEagle3")


def apply_capture_gate(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    original = worker.supports_eagle3

    @functools.wraps(original)
    def supports_capture(model: Any) -> bool:
        base = base_model(model)
        return bool(original(model)) or (base is not None and hasattr(base, "layers"))

    patcher.replace(worker, "supports_eagle3", supports_capture)


CAPTURE_GATE = Adapter(
    id="capture-gate",
    patches=("speculators.data_generation.custom_worker.supports_eagle3",),
    why="0.3.0 refuses models without vLLM's SupportsEagle3 interface although capture only needs `layers`",
    vllm_change="models gained SupportsEagle3 late (Qwen3-MoE 0.11.2, DeepSeek-V2/V3 0.18.1; Mixtral never)",
    detect="custom_worker defines the name supports_eagle3",
    delete_when="speculators 0.3.0 is no longer supported (0.4.x checks for `layers` instead)",
    side="worker",
    probe=probe_capture_gate,
    apply=apply_capture_gate,
    speculators=SPECULATORS_0_3_ONLY,
)
