# ruff: noqa: E501  (signature tables read best one per line)
"""Fake "vLLM" callables with the old and new signature shapes, and a fake generator module whose
source makes the calls speculators 0.3.0 / 0.4.x make (read by the adapters' AST probes)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from tests.unit.source_module import load_source


def recording_generator_module() -> tuple[ModuleType, list[dict[str, Any]]]:
    """A stand-in for speculators' generator module whose ``VllmConfig`` records the keywords of each
    call (and returns them as a namespace): what a VllmConfig-rewriting adapter hands vLLM."""
    received: list[dict[str, Any]] = []

    def vllm_config(**kwargs: Any) -> SimpleNamespace:
        received.append(kwargs)
        return SimpleNamespace(**kwargs)

    module = ModuleType("speculators.data_generation.vllm_hidden_states_generator")
    module.VllmConfig = vllm_config  # type: ignore[attr-defined]
    return module, received


class Recorder:
    calls: list[dict[str, Any]]

    def __init__(self, **kwargs: Any) -> None:
        type(self).calls.append(kwargs)


def vllm_callable(name: str, params: str) -> Any:
    """A class whose __init__ has exactly ``params`` and records the keywords it got."""
    namespace: dict[str, Any] = {}
    body = ", ".join(p.split("=")[0].strip() for p in params.split(",") if p.strip() and p.strip() != "*")
    source = f"def __init__(self, {params}):\n    type(self).calls.append(dict(zip({body.split(', ')!r}, [{body}])))\n"
    exec(source, namespace)
    cls = type(name, (), {"__init__": namespace["__init__"], "calls": [], "__module__": "vllm.fake"})
    return cls


OLD = {
    "Request": "request_id, prompt_token_ids, sampling_params, pooling_params, eos_token_id, arrival_time=None, block_hasher=None",
    "Scheduler": "vllm_config, kv_cache_config, structured_output_manager",
    "SchedulerConfig": "max_num_seqs=None, max_model_len=None, max_num_batched_tokens=None",
    "CacheConfig": "block_size=None, gpu_memory_utilization=0.9, enable_prefix_caching=None",
    "get_kv_cache_config_from_groups": "vllm_config, kv_cache_groups, kv_cache_specs, available_memory",
}
NEW = {
    "Request": "request_id, prompt_token_ids, sampling_params, pooling_params, arrival_time=None, block_hasher=None",
    "Scheduler": "vllm_config, kv_cache_config, structured_output_manager, block_size, hash_block_size=None",
    "SchedulerConfig": "max_model_len, is_encoder_decoder, max_num_seqs=128, max_num_batched_tokens=2048",
    "CacheConfig": "block_size=None, gpu_memory_utilization=0.9, enable_prefix_caching=True",
    "get_kv_cache_config_from_groups": "vllm_config, kv_cache_groups, available_memory",
}

# The keyword sets each speculators version passes (from their sources).
SPEC_CALLS = {
    "0.3": {
        "Request": "request_id=1, prompt_token_ids=[1], sampling_params=None, pooling_params=None, eos_token_id=2, arrival_time=0.0",
        "Scheduler": "vllm_config=cfg, kv_cache_config=kv, structured_output_manager=None",
        "SchedulerConfig": "max_num_seqs=32, max_model_len=64, max_num_batched_tokens=64",
        "CacheConfig": "block_size=16, gpu_memory_utilization=0.5",
        "get_kv_cache_config_from_groups": "vllm_config=cfg, kv_cache_groups=groups, kv_cache_specs=specs, available_memory=1",
    },
    "0.4": {
        "Request": "request_id=1, prompt_token_ids=[1], sampling_params=None, pooling_params=None, eos_token_id=2, arrival_time=0.0, block_hasher=None",
        "Scheduler": "vllm_config=cfg, kv_cache_config=kv, structured_output_manager=None, block_size=16",
        "SchedulerConfig": "max_num_seqs=32, max_model_len=64, max_num_batched_tokens=64, is_encoder_decoder=False",
        "CacheConfig": "block_size=16, gpu_memory_utilization=0.5, enable_prefix_caching=False",
        "get_kv_cache_config_from_groups": "vllm_config=cfg, kv_cache_groups=groups, available_memory=1",
    },
}


def fake_generator(tmp: Path, speculators: str, shapes: dict[str, str]) -> ModuleType:
    calls = "\n".join(f"    {name}({args})" for name, args in SPEC_CALLS[speculators].items())
    source = textwrap.dedent(
        """
        VLLM_BLOCK_SIZE = 16

        def make_calls(cfg, kv, groups, specs):
        {calls}
        """
    ).format(calls=calls)
    module = load_source(tmp, f"fake_generator_{speculators.replace('.', '_')}", source)
    for callee, params in shapes.items():
        setattr(module, callee, vllm_callable(callee, params))
    return module
