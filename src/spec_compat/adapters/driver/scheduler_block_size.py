"""Adapter ``scheduler-block-size``: Scheduler(block_size=...)."""

from __future__ import annotations

from typing import Any

from ...calls import KeywordPlan, accepts, innermost
from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..speculators_code import generator_module
from ..support import install_call_adapter, keyword_mismatch, passes_keyword
from ..unit import Adapter

# vLLM 0.11.2 added the required block_size; 0.20.2 added hash_block_size. speculators 0.3.0 passes
# none, 0.4.x passes its hard-coded 16. The scheduler must use the block size of the KV cache
# groups the workers reported.


def _resolved_block_sizes(kwargs: dict[str, Any]) -> tuple[int, int | None]:
    vllm_config = kwargs["vllm_config"]
    kv_cache_config = kwargs.get("kv_cache_config")
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        if kv_cache_config is not None:
            scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
            return int(scheduler_block_size), int(hash_block_size)
    except ImportError:
        pass
    return int(vllm_config.cache_config.block_size), None


def probe_scheduler_block_size(ctx: Context) -> Probe:
    mismatch = keyword_mismatch(ctx, "Scheduler", "block_size")
    if mismatch == "missing":
        return Probe(True, "Scheduler requires block_size (vLLM >= 0.11.2); speculators does not pass it")
    if mismatch == "unexpected":
        return Probe(True, "speculators passes block_size; this Scheduler does not take it")
    if passes_keyword(ctx, "Scheduler", "block_size"):
        return Probe(True, "speculators passes its hard-coded block size; the KV cache's resolved one is used")
    return Probe(False, "Scheduler takes no block size")


def apply_scheduler_block_size(ctx: Context, patcher: AdapterPatcher) -> None:
    target = innermost(generator_module(ctx).Scheduler)
    override: dict[str, Any] = {}
    drop: set[str] = set()
    if accepts(target, "block_size"):
        override["block_size"] = lambda kw: _resolved_block_sizes(kw)[0]
    else:
        drop.add("block_size")
    if accepts(target, "hash_block_size"):
        override["hash_block_size"] = lambda kw: _resolved_block_sizes(kw)[1]
    install_call_adapter(ctx, patcher, "Scheduler", KeywordPlan(drop=frozenset(drop), override=override))


SCHEDULER_BLOCK_SIZE = Adapter(
    id="scheduler-block-size",
    patches=("speculators.data_generation.vllm_hidden_states_generator.Scheduler",),
    how="keywords block_size, hash_block_size",
    why="Scheduler requires block_size (0.3.0 omits it); 0.4 passes its hard-coded 16, not the KV cache's block size",
    vllm_change="0.11.2 required block_size; 0.20.2 hash_block_size",
    detect="signature vs AST: passed by speculators",
    delete_when="speculators passes the resolved block size",
    side="driver",
    probe=probe_scheduler_block_size,
    apply=apply_scheduler_block_size,
)
