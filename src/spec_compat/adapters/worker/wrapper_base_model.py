"""Adapter ``wrapper-base-model``: speculators' capture set-up finds the text base model of a
multimodal wrapper."""

from __future__ import annotations

import functools
import logging
from typing import Any

import wrapt

from ...options import Context
from ...patching import AdapterPatcher
from .. import speculators_code
from ..probe import Probe
from ..speculators_code import extension_method, worker_module
from ..support import find_base_model
from ..unit import Adapter

logger = logging.getLogger("spec_compat.worker")


class WrapperView(wrapt.ObjectProxy):  # type: ignore[type-arg, misc]
    """A multimodal wrapper as speculators' capture set-up reads it: ``.model`` and
    ``.get_language_model().model`` are the text base model; every other attribute is the wrapper's."""

    def __init__(self, wrapper: Any, base: Any) -> None:
        super().__init__(wrapper)
        self._self_model = base

    @property
    def model(self) -> Any:
        return self._self_model

    def get_language_model(self) -> Any:
        return self  # its `.model` is the base model


def _speculators_lookup_works(model: Any, reads_language_model: bool) -> bool:
    """Whether speculators' own expression for the base model gives a module with ``layers``."""
    try:
        if reads_language_model and hasattr(model, "get_language_model"):
            base = model.get_language_model().model
        else:
            base = model.model
    except Exception:  # noqa: BLE001 - AttributeError / NotImplementedError: the lookup fails
        return False
    return hasattr(base, "layers")


def _setup_reads(worker: Any) -> set[str]:
    setup = vars(worker.HiddenStatesWorkerExtension)["_setup_hidden_states_capture"]
    return speculators_code.attribute_names_used(setup) & {"model", "get_language_model"}


def probe_wrapper_base_model(ctx: Context) -> Probe:
    reads = _setup_reads(worker_module(ctx))
    if "model" not in reads:
        return Probe(False, "speculators' capture set-up does not look up a base model")
    how = "model.get_language_model().model or model.model" if "get_language_model" in reads else "model.model"
    return Probe(
        True, f"speculators finds the base model as {how}; a multimodal wrapper's is found by probing at set-up"
    )


def apply_wrapper_base_model(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    extension_cls, original = extension_method(ctx, "_setup_hidden_states_capture")
    reads_language_model = "get_language_model" in _setup_reads(worker)

    @functools.wraps(original)
    def _setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> Any:
        runner = self.model_runner
        model = runner.model
        if _speculators_lookup_works(model, reads_language_model):
            return original(self, layer_ids)
        base = find_base_model(model)
        if base is None:
            return original(self, layer_ids)  # speculators' own error names the model
        logger.info("spec_compat: %s: capturing from its text model %s", type(model).__name__, type(base).__name__)
        runner.model = WrapperView(model, base)
        try:
            return original(self, layer_ids)
        finally:
            runner.model = model

    patcher.replace(extension_cls, "_setup_hidden_states_capture", _setup_hidden_states_capture)


WRAPPER_BASE_MODEL = Adapter(
    id="wrapper-base-model",
    patches=("speculators.data_generation.custom_worker.HiddenStatesWorkerExtension._setup_hidden_states_capture",),
    why=(
        "capture set-up of a multimodal wrapper fails: AttributeError: 'KimiK25ForConditionalGeneration' object has "
        "no attribute 'model' (0.3.0 reads model.model; 0.4.x get_language_model().model, whose shape differs "
        "between releases and models)"
    ),
    vllm_change=(
        "none for one release: multimodal wrappers keep their text model as `.language_model` "
        "(KimiK25ForConditionalGeneration in 0.32.0, Llava-style models), not `.model`; what get_language_model() "
        "(SupportsMultiModal) returns depends on the release and the model"
    ),
    detect=(
        "AST: which of model / get_language_model the set-up reads; at set-up: whether that lookup gives a module "
        "with `layers`, else the base model found by probing (get_language_model(), then the one child holding a "
        "decoder stack)"
    ),
    delete_when="speculators finds the base model through vLLM's own interface for every model",
    side="worker",
    probe=probe_wrapper_base_model,
    apply=apply_wrapper_base_model,
)
