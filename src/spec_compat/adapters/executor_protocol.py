"""How speculators drives the engine vs what this vLLM's executor expects: the reply shape of
``collective_rpc(unique_reply_rank=k)``, ``execute_model`` then ``sample_tokens``, the KV cache
layout the engine core resolves, and the model runner speculators' capture needs.

Adapters ``executor-reply-shape``, ``executor-sample-tokens``, ``executor-kv-layout``,
``executor-model-runner-v1``; each switches one behaviour of spec_compat's executor subclass.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ..environ import scoped_environ
from ..options import Context
from ..patching import AdapterPatcher
from . import speculators_code
from .executor import install_hook
from .executor_hooks import CORE_STAGE, ExecutorHook, RpcCall
from .probe import Probe
from .unit import SPECULATORS_0_3_ONLY, Adapter

V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"

# ---- collective_rpc(unique_reply_rank=k) return shape -------------------------------------------------
# vLLM <= 0.11.0 returned [result]; 0.11.2+ returns the result itself (PR in 0.11.2 with
# kv_output_aggregator). speculators 0.3.0 indexes [0]; 0.4.x uses the value.


def _vllm_returns_bare_value(base: Any) -> bool:
    import inspect

    return "kv_output_aggregator" in inspect.signature(base.collective_rpc).parameters


class ReplyAsList(ExecutorHook):
    stage = CORE_STAGE + 20  # last: the shape speculators indexes

    def on_reply(self, executor: Any, call: RpcCall, result: Any) -> Any:
        return [result] if call.reply_rank is not None else result


def apply_reply_shape(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, ReplyAsList())


def probe_reply_shape(ctx: Context) -> Probe:
    generate = speculators_code.generator_module(ctx).VllmHiddenStatesGenerator.generate
    expects_list = speculators_code.indexes_unique_reply(generate)
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    bare = _vllm_returns_bare_value(MultiprocExecutor)
    if expects_list and bare:
        return Probe(True, "speculators indexes the reply [0]; this vLLM returns the bare rank result")
    if not expects_list and not bare:
        return Probe(False, "speculators uses the reply as a dict; this vLLM returns a one-element list", blocking=True)
    return Probe(False, "reply shape matches what speculators expects")


EXECUTOR_REPLY_SHAPE = Adapter(
    id="executor-reply-shape",
    notes="""
    why: 0.3.0 indexes [0] on the reply, now the first layer's tensor ('Boolean value of Tensor ... is ambiguous'); the
        771 x [512] corruption in the user's story
    vllm change: 0.11.2 returns the bare rank-k result instead of [result]
    detect: AST: speculators subscripts the reply; signature: collective_rpc has kv_output_aggregator
    delete when: speculators 0.3.0 is no longer supported
    patches: MultiprocExecutor.collective_rpc(unique_reply_rank=k) result
    """,
    side="driver",
    probe=probe_reply_shape,
    apply=apply_reply_shape,
    # every release: the probe also finds the reverse mismatch (0.4.x on vLLM <= 0.11.0, blocking)
)


# ---- execute_model() + sample_tokens() split (vLLM 0.11.2) -----------------------------------------


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
    notes="""
    why: 'State error: sample_tokens() must be called after execute_model() returns None.'
    vllm change: 0.11.2 split execute_model / sample_tokens
    detect: hasattr(MultiprocExecutor, 'sample_tokens') and AST: speculators never calls it
    delete when: speculators 0.3.0 is no longer supported
    patches: MultiprocExecutor.execute_model (calls sample_tokens(None) when execute_model returns None)
    """,
    side="driver",
    probe=probe_sample_tokens,
    apply=apply_sample_tokens,
    speculators=SPECULATORS_0_3_ONLY,
)


# ---- KV cache layout (vLLM 0.29.0) -----------------------------------------------------------------


def resolve_kv_cache_layout(executor: Any) -> None:
    """Once the workers are up: the layout resolved and published as the engine core does."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout as resolve

    specs = [spec for worker_specs in executor.get_kv_cache_specs() for spec in worker_specs.values()]
    layout = resolve(executor.vllm_config, executor.get_supported_kv_cache_layouts(), specs)
    executor.set_kv_cache_layout(layout.name)


class ResolveKvLayout(ExecutorHook):
    def started(self, executor: Any) -> None:
        resolve_kv_cache_layout(executor)


def apply_kv_layout(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, ResolveKvLayout())


def probe_kv_layout(ctx: Context) -> Probe:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if not hasattr(MultiprocExecutor, "set_kv_cache_layout"):
        return Probe(False, "this vLLM has no engine-resolved KV cache layout")
    try:
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: F401
    except ImportError:
        return Probe(False, "set_kv_cache_layout exists but resolve_kv_cache_layout does not", blocking=True)
    return Probe(True, "the engine core resolves the KV cache layout and sends it to workers; speculators does not")


EXECUTOR_KV_LAYOUT = Adapter(
    id="executor-kv-layout",
    notes="""
    why: workers fail allocating the KV cache: layout never resolved
    vllm change: 0.29.0 engine core resolves the layout (resolve_kv_cache_layout, set_kv_cache_layout)
    detect: hasattr(MultiprocExecutor, 'set_kv_cache_layout')
    delete when: the layout is resolved inside initialize_from_config
    patches: MultiprocExecutor.__init__ (resolve and publish the KV cache layout)
    """,
    side="driver",
    probe=probe_kv_layout,
    apply=apply_kv_layout,
)


# ---- Model Runner V2 has no input_batch (default from 0.22.1 on GPU) ----------------------------------


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
    notes="""
    why: speculators 0.4 reads model_runner.input_batch, which Model Runner V2 lacks; 0.3.0 slices captures in V1 batch
        order, V2 sorts the batch by token count (silently wrong)
    vllm change: 0.22.1 V2 default for Qwen3 on GPU, 0.29.0 for all models
    detect: AST: the worker reads input_batch; vllm.envs has VLLM_USE_V2_MODEL_RUNNER
    delete when: vLLM drops the V1 runner (then the capture must learn V2's batch order)
    patches: VLLM_USE_V2_MODEL_RUNNER=0 in the environment while the workers start (if unset)
    """,
    side="driver",
    probe=probe_v1_model_runner,
    apply=apply_v1_model_runner,
)
