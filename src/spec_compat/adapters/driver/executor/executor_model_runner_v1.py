"""Adapter ``executor-model-runner-v1``: Model Runner V2 has no input_batch (default from 0.22.1 on GPU)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ....environ import scoped_environ
from ....options import Context
from ....patching import AdapterPatcher
from ... import speculators_code
from ...probe import Probe
from ...unit import Adapter
from .executor import install_hook
from .hooks import ExecutorHook

V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


class ForceV1ModelRunner(ExecutorHook):
    def start(self, executor: Any) -> contextlib.AbstractContextManager[object] | None:
        """``VLLM_USE_V2_MODEL_RUNNER=0`` for the workers' start, unless the user set it."""
        return None if V2_RUNNER_ENV in os.environ else scoped_environ({V2_RUNNER_ENV: "0"})


def apply_v1_model_runner(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, ForceV1ModelRunner())


def probe_v1_model_runner(ctx: Context) -> Probe:
    import vllm.envs as vllm_envs

    if V2_RUNNER_ENV not in dir(vllm_envs):
        return Probe(False, "this vLLM has no Model Runner V2 switch")
    worker = ctx.worker
    if worker is not None:
        store = worker.HiddenStatesWorkerExtension._store_captured_states
        if "input_batch" in speculators_code.attribute_names_used(store):
            return Probe(True, "speculators reads model_runner.input_batch, which Model Runner V2 does not have")
    return Probe(
        True,
        "speculators slices captures in the V1 runner's batch order; V2 sorts the batch by token count",
    )


EXECUTOR_MODEL_RUNNER_V1 = Adapter(
    id="executor-model-runner-v1",
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how="hook ForceV1ModelRunner: VLLM_USE_V2_MODEL_RUNNER=0 in the environment while the workers start (if unset)",
    why=(
        "speculators 0.4 reads model_runner.input_batch, which Model Runner V2 lacks; 0.3.0 slices captures in V1 "
        "batch order, V2 sorts the batch by token count (silently wrong)"
    ),
    vllm_change="0.22.1 V2 default for Qwen3 on GPU, 0.29.0 V2 default for all models",
    detect="AST: the worker reads input_batch; vllm.envs has VLLM_USE_V2_MODEL_RUNNER",
    delete_when="vLLM drops the V1 runner (then the capture must learn V2's batch order)",
    side="driver",
    probe=probe_v1_model_runner,
    apply=apply_v1_model_runner,
    changes_seen_in_nightly=("0.29.0 V2 default for all models: 0.28.1.dev202608281259 (2026-08-28)",),
)
