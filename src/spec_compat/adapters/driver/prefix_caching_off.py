"""Adapter ``prefix-caching-off``: CacheConfig(enable_prefix_caching=False)."""

from __future__ import annotations

from ...calls import accepts, innermost
from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..speculators_code import generator_module
from ..support import override_keyword, passes_keyword
from ..unit import SPECULATORS_0_3_ONLY, Adapter

# vLLM 0.12.0 turned prefix caching on by default. Hidden-state extraction must run every prompt
# token through the model: a prefix-cache hit skips those tokens, and speculators 0.3.0's
# requests carry no block hasher (crash in block_pool). 0.4.x already passes False.


def probe_prefix_caching_off(ctx: Context) -> Probe:
    target = innermost(generator_module(ctx).CacheConfig)
    if not accepts(target, "enable_prefix_caching"):
        return Probe(False, "CacheConfig has no enable_prefix_caching")
    if passes_keyword(ctx, "CacheConfig", "enable_prefix_caching"):
        return Probe(False, "speculators already passes enable_prefix_caching")
    return Probe(True, "speculators leaves prefix caching at vLLM's default (on since 0.12.0)")


def apply_prefix_caching_off(ctx: Context, patcher: AdapterPatcher) -> None:
    override_keyword(ctx, patcher, "CacheConfig", "enable_prefix_caching", lambda kw: False)


PREFIX_CACHING_OFF = Adapter(
    id="prefix-caching-off",
    patches=("speculators.data_generation.vllm_hidden_states_generator.CacheConfig",),
    how="keyword enable_prefix_caching=False",
    why="prefix-cache hits skip tokens the capture needs; 0.3.0's requests have no block hasher (crash in block_pool)",
    vllm_change="0.12.0 enable_prefix_caching defaults to True",
    detect="AST: speculators does not pass enable_prefix_caching; CacheConfig accepts it",
    delete_when="speculators 0.3.0 is no longer supported",
    side="driver",
    probe=probe_prefix_caching_off,
    apply=apply_prefix_caching_off,
    speculators=SPECULATORS_0_3_ONLY,
)
