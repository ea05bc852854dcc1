"""Adapter ``capture-setup``: capture set-up checks and the embed-method rename."""

from __future__ import annotations

import functools
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from .. import speculators_code
from ..probe import Probe
from ..speculators_code import extension_method, worker_module
from ..support import base_model
from ..unit import Adapter

# vLLM 0.11.2 renamed get_input_embeddings -> embed_input_ids on base models. The name the
# installed speculators' forward calls is aliased on the captured model instance only.

EMBED_NAMES = ("embed_input_ids", "get_input_embeddings")


def _embed_name_called(worker: Any) -> str | None:
    used = speculators_code.attribute_names_used(worker._patched_forward)
    return next((name for name in EMBED_NAMES if name in used), None)


def probe_embed_alias(ctx: Context) -> Probe:
    called = _embed_name_called(worker_module(ctx))
    if called is None:
        return Probe(False, "speculators' forward calls no embedding method")
    from vllm.model_executor.models import interfaces_base

    has = any(hasattr(interfaces_base.VllmModel, n) for n in (called,))
    if has:
        return Probe(True, f"speculators calls {called}(); aliased on models that only have the other name")
    return Probe(True, f"speculators calls {called}(), which this vLLM's model interface does not define")


def _setup_checks(extension: Any, base: Any) -> None:
    runner = extension.model_runner
    hf_config = getattr(getattr(runner, "model_config", None), "hf_config", None)
    if getattr(hf_config, "llama_4_scaling", None):
        raise NotImplementedError(
            "this checkpoint sets llama_4_scaling, which the model's own forward passes to every layer; "
            "speculators' capture forward does not, so its hidden states would be wrong"
        )
    sharded = [
        name for name, module in base.named_modules() if getattr(module, "use_sequence_parallel_moe", False) is True
    ]
    if sharded:
        raise NotImplementedError(
            f"sequence-parallel MoE is on ({sharded[:3]}...): layers return token shards that the model "
            "re-gathers and speculators' capture forward does not; disable expert/sequence parallelism"
        )


def apply_capture_setup(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    extension_cls, original = extension_method(ctx, "_setup_hidden_states_capture")
    called = _embed_name_called(worker)
    reads_input_batch = "input_batch" in speculators_code.attribute_names_used(extension_cls._store_captured_states)

    @functools.wraps(original)
    def _setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> Any:
        result = original(self, layer_ids)
        base = base_model(self.model_runner.model)
        if called is not None and base is not None and not hasattr(base, called):
            other = next((n for n in EMBED_NAMES if n != called and hasattr(base, n)), None)
            if other is None:
                raise AttributeError(f"{type(base).__name__} has neither {called}() nor any known embedding method")
            setattr(base, called, getattr(base, other))
        if reads_input_batch and not hasattr(self.model_runner, "input_batch"):
            raise NotImplementedError(
                f"{type(self.model_runner).__name__} has no input_batch (Model Runner V2); speculators' "
                "capture needs the V1 runner: unset VLLM_USE_V2_MODEL_RUNNER or set it to 0"
            )
        if base is not None:
            _setup_checks(self, base)
        return result

    patcher.replace(extension_cls, "_setup_hidden_states_capture", _setup_hidden_states_capture)


CAPTURE_SETUP = Adapter(
    id="capture-setup",
    patches=("speculators.data_generation.custom_worker.HiddenStatesWorkerExtension._setup_hidden_states_capture",),
    why=(
        "the embedding method was renamed; Model Runner V2, llama_4_scaling and sequence-parallel MoE make "
        "speculators' capture wrong or crash later: alias the name, refuse the rest at set-up"
    ),
    vllm_change=(
        "0.11.2 get_input_embeddings -> embed_input_ids; 0.12.0 llama_4_scaling (DeepseekV2); 0.22.1 Model Runner V2 "
        "default on GPU; 0.25.1 token-sharded DeepseekV2 layers"
    ),
    detect="AST: which embedding name speculators' forward calls, and whether it reads input_batch",
    delete_when="speculators' capture forward is replaced by vLLM-native aux hidden-state capture",
    side="worker",
    probe=probe_embed_alias,
    apply=apply_capture_setup,
    # checks (and aliases the embedding on) the base model that wrapper-base-model's set-up captured from
    after=("wrapper-base-model",),
    changes_seen_in_nightly=("0.25.1 token-sharded DeepseekV2 layers: 0.24.1.dev202606291104 (2026-06-29)",),
)
