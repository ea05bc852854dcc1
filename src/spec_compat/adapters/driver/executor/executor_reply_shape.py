"""Adapter ``executor-reply-shape``: collective_rpc(unique_reply_rank=k) return shape."""

from __future__ import annotations

from typing import Any

from ....options import Context
from ....patching import AdapterPatcher
from ... import speculators_code
from ...probe import Probe
from ...unit import Adapter
from .executor import install_hook
from .hooks import CORE_STAGE, ExecutorHook, RpcCall

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
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how="hook ReplyAsList: the collective_rpc(unique_reply_rank=k) result",
    why=(
        "0.3.0 indexes [0] on the reply, now the first layer's tensor ('Boolean value of Tensor ... is ambiguous'); "
        "the 771 x [512] corruption in the user's story"
    ),
    vllm_change="0.11.2 returns the bare rank-k result instead of [result]",
    detect="AST: speculators subscripts the reply; signature: collective_rpc has kv_output_aggregator",
    delete_when="speculators 0.3.0 is no longer supported",
    side="driver",
    probe=probe_reply_shape,
    apply=apply_reply_shape,
    # every release: the probe also finds the reverse mismatch (0.4.x on vLLM <= 0.11.0, blocking)
)
