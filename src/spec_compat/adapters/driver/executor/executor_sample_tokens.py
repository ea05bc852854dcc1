"""Adapter ``executor-sample-tokens``: execute_model() + sample_tokens() split (vLLM 0.11.2)."""

from __future__ import annotations

from typing import Any

from ....options import Context
from ....patching import AdapterPatcher
from ... import speculators_code
from ...probe import Probe
from ...unit import SPECULATORS_0_3_ONLY, Adapter
from .executor import install_hook
from .hooks import ExecutorHook


class SampleAfterExecute(ExecutorHook):
    def after_step(self, executor: Any, output: Any) -> Any:
        if output is None and hasattr(executor, "sample_tokens"):
            return executor.sample_tokens(None)
        return output


def apply_sample_tokens(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, SampleAfterExecute())


def probe_sample_tokens(ctx: Context) -> Probe:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    generate = speculators_code.generator_module(ctx).VllmHiddenStatesGenerator.generate
    if not hasattr(MultiprocExecutor, "sample_tokens"):
        return Probe(False, "this vLLM samples inside execute_model")
    if speculators_code.calls_method(generate, "sample_tokens"):
        return Probe(False, "speculators calls sample_tokens() itself")
    return Probe(True, "execute_model() returns None and sample_tokens() must follow; speculators never calls it")


EXECUTOR_SAMPLE_TOKENS = Adapter(
    id="executor-sample-tokens",
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how="hook SampleAfterExecute: execute_model calls sample_tokens(None) when execute_model returns None",
    why="'State error: sample_tokens() must be called after execute_model() returns None.'",
    vllm_change="0.11.2 split execute_model / sample_tokens",
    detect="hasattr(MultiprocExecutor, 'sample_tokens') and AST: speculators never calls it",
    delete_when="speculators 0.3.0 is no longer supported",
    side="driver",
    probe=probe_sample_tokens,
    apply=apply_sample_tokens,
    speculators=SPECULATORS_0_3_ONLY,
)
