"""Adapter ``executor-all-ranks-reply``: with ``unique_reply_rank=k`` vLLM reads only rank k's reply,
so an exception on another rank is logged in that worker and never reaches the caller; every rank
is asked instead and rank k's reply handed back (a failure is then diagnosed by the subclass).
"""

from __future__ import annotations

from typing import Any

from ....options import Context
from ....patching import AdapterPatcher
from ...probe import Probe
from ...unit import Adapter
from .executor import install_hook
from .hooks import CORE_STAGE, ExecutorHook, RpcCall


class AllRanksReply(ExecutorHook):
    stage = CORE_STAGE - 20  # hands rank k's reply on to every later stage

    def before_rpc(self, executor: Any, call: RpcCall) -> None:
        call.all_ranks = call.speculators_rpc and call.reply_rank is not None
        if call.all_ranks:
            call.kwargs["unique_reply_rank"] = None

    def on_reply(self, executor: Any, call: RpcCall, result: Any) -> Any:
        if call.all_ranks and call.kwargs.get("non_block") is not True:
            return result[call.reply_rank]
        return result


def probe_all_ranks_reply(ctx: Context) -> Probe:
    return Probe(
        True,
        "with unique_reply_rank vLLM only reads rank k's reply: an exception on another rank is "
        "logged in that worker and never reaches the caller",
    )


def apply_all_ranks_reply(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, AllRanksReply())


EXECUTOR_ALL_RANKS_REPLY = Adapter(
    id="executor-all-ranks-reply",
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how="hook AllRanksReply: collective_rpc for speculators' worker methods asks every rank",
    why="with unique_reply_rank=k an exception on another rank is only logged in that worker",
    vllm_change="all releases (vLLM #23985)",
    detect="always",
    delete_when="vLLM reports failures from every rank",
    side="driver",
    probe=probe_all_ranks_reply,
    apply=apply_all_ranks_reply,
)
