"""Adapter ``executor-kv-layout``: KV cache layout (vLLM 0.29.0)."""

from __future__ import annotations

from typing import Any

from ....options import Context
from ....patching import AdapterPatcher
from ...probe import Probe
from ...unit import Adapter
from .executor import install_hook
from .hooks import ExecutorHook


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
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how="hook ResolveKvLayout: once the workers are up, resolve and publish the KV cache layout",
    why="workers fail allocating the KV cache: layout never resolved",
    vllm_change="0.29.0 engine core resolves the layout (resolve_kv_cache_layout, set_kv_cache_layout)",
    detect="hasattr(MultiprocExecutor, 'set_kv_cache_layout')",
    first_seen_nightly="0.27.2.dev202608220641 (2026-08-22)",
    delete_when="the layout is resolved inside initialize_from_config",
    side="driver",
    probe=probe_kv_layout,
    apply=apply_kv_layout,
)
