"""wrapper-base-model: speculators' capture set-up finds the text base model of any multimodal wrapper
(found by probing, not by class name), against fakes of speculators 0.3.0 (``model.model``) and
0.4.x (``model.get_language_model().model``) set-up code."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from spec_compat.adapters.support import find_base_model
from spec_compat.adapters.worker.wrapper_base_model import WrapperView
from spec_compat.detect import detect
from spec_compat.options import Context, Options
from spec_compat.patching import Patcher
from tests.unit.apply_adapters import apply_adapters
from tests.unit.fake_worker import fake_worker
from tests.unit.source_module import load_source
from tests.unit.test_worker_adapters import NewBase

# speculators 0.4.0.1's set-up lookup (a model with get_language_model() is a vision-language model).
WORKER_04_LANGUAGE_MODEL = """
import types

def _patched_forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_kwargs):
    hidden_states = self.embed_input_ids(input_ids)
    residual = None
    for layer in self.layers[self.start_layer:self.end_layer]:
        hidden_states, residual = layer(hidden_states=hidden_states, positions=positions, residual=residual)
    return hidden_states

class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids):
        model = self.model_runner.model
        if hasattr(model, "get_language_model"):
            base_model = model.get_language_model().model
        elif hasattr(model, "model") and hasattr(model.model, "layers"):
            base_model = model.model
        else:
            raise AttributeError("Could not find base model with 'layers' attribute")
        self.seen_model = model
        base_model.forward = types.MethodType(_patched_forward, base_model)

    def _store_captured_states(self, aux_hidden_states):
        self._captured_states = aux_hidden_states
"""

ADAPTERS = ["capture-gate", "wrapper-base-model", "capture-setup"]


class Module:
    """Just enough of torch.nn.Module: named_children() over the attributes that are modules."""

    def named_children(self) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in vars(self).items() if isinstance(v, (Module, NewBase))]


class CausalLM(Module):
    def __init__(self, base: Any) -> None:
        self.model = base


class VisionTower(Module):
    def __init__(self) -> None:
        self.encoder = SimpleNamespace(blocks=[])


class WrapperReturningCausalLM(Module):  # Kimi-K2.5 on vLLM 0.32: get_language_model() -> DeepseekV2ForCausalLM
    def __init__(self, base: Any) -> None:
        self.vision_tower = VisionTower()
        self.language_model = CausalLM(base)

    def get_language_model(self) -> Any:
        return self.language_model


class WrapperReturningBase(WrapperReturningCausalLM):  # get_language_model() -> the base model itself
    def get_language_model(self) -> Any:
        return self.language_model.model


class WrapperWithoutMethod(Module):  # no get_language_model(): the one child holding a decoder stack
    def __init__(self, base: Any) -> None:
        self.vision_tower = VisionTower()
        self.text = CausalLM(base)


class WrapperRaising(WrapperWithoutMethod):  # an abstract get_language_model()
    def get_language_model(self) -> Any:
        raise NotImplementedError


def _worker(tmp_path: Path, style: str) -> ModuleType:
    if style == "0.4":
        return load_source(tmp_path, "fake_custom_worker_04_language_model", WORKER_04_LANGUAGE_MODEL)
    return fake_worker(tmp_path, "0.3")


def _apply(module: ModuleType) -> tuple[Patcher, list[str]]:
    return apply_adapters(Context(env=detect(), options=Options(), worker=module), ADAPTERS)


def _extension(module: ModuleType, model: Any) -> Any:
    extension = module.HiddenStatesWorkerExtension()
    extension.model_runner = SimpleNamespace(model=model, model_config=SimpleNamespace(hf_config=SimpleNamespace()))
    return extension


WRAPPERS = [WrapperReturningCausalLM, WrapperReturningBase, WrapperWithoutMethod, WrapperRaising]


@pytest.mark.parametrize("style", ["0.3", "0.4"])
@pytest.mark.parametrize("wrapper_cls", WRAPPERS, ids=[w.__name__ for w in WRAPPERS])
def test_capture_set_up_on_a_wrapper(tmp_path: Path, style: str, wrapper_cls: type) -> None:
    module = _worker(tmp_path, style)
    original = vars(module.HiddenStatesWorkerExtension)["_setup_hidden_states_capture"]
    patcher, applied = _apply(module)
    try:
        assert "wrapper-base-model" in applied
        base = NewBase()
        wrapper = wrapper_cls(base)
        extension = _extension(module, wrapper)
        extension._setup_hidden_states_capture([0])
        assert base.forward(3, positions=None) == 32  # speculators' forward is bound to the text base model
        assert extension.model_runner.model is wrapper  # the view was only for the set-up
    finally:
        patcher.revert()
    assert vars(module.HiddenStatesWorkerExtension)["_setup_hidden_states_capture"] is original


@pytest.mark.parametrize("style", ["0.3", "0.4"])
def test_without_the_adapter_a_wrapper_fails(tmp_path: Path, style: str) -> None:
    """The break it answers: 0.3.0 reads model.model; 0.4.x get_language_model().model."""
    module = _worker(tmp_path, style)
    wrapper = WrapperReturningCausalLM(NewBase()) if style == "0.3" else WrapperReturningBase(NewBase())
    extension = _extension(module, wrapper)
    extension.model_runner.model.declares_eagle3 = True
    with pytest.raises(AttributeError, match="model"):
        extension._setup_hidden_states_capture([0])


def test_models_speculators_handles_are_untouched(tmp_path: Path) -> None:
    module = _worker(tmp_path, "0.4")
    patcher, _ = _apply(module)
    try:
        for model in (CausalLM(NewBase()), WrapperReturningCausalLM(NewBase())):
            extension = _extension(module, model)
            extension._setup_hidden_states_capture([0])
            assert extension.seen_model is model  # no view: speculators' own lookup works
    finally:
        patcher.revert()


def test_find_base_model_probes_and_refuses_ambiguity() -> None:
    base = NewBase()
    assert find_base_model(CausalLM(base)) is base
    for wrapper_cls in WRAPPERS:
        assert find_base_model(wrapper_cls(base)) is base, wrapper_cls.__name__
    ambiguous = WrapperWithoutMethod(base)
    ambiguous.other = CausalLM(NewBase())  # type: ignore[attr-defined]
    assert find_base_model(ambiguous) is None
    assert find_base_model(SimpleNamespace()) is None
    view = WrapperView(WrapperReturningBase(base), base)
    assert view.model is base and view.get_language_model().model is base
    assert isinstance(view.vision_tower, VisionTower)  # everything else is the wrapper's


def test_ambiguous_wrapper_keeps_speculators_own_error(tmp_path: Path) -> None:
    module = _worker(tmp_path, "0.3")
    patcher, _ = _apply(module)
    try:
        ambiguous = WrapperWithoutMethod(NewBase())
        ambiguous.other = CausalLM(NewBase())  # type: ignore[attr-defined]
        ambiguous.declares_eagle3 = True  # type: ignore[attr-defined]
        with pytest.raises(AttributeError, match="model"):
            _extension(module, ambiguous)._setup_hidden_states_capture([0])
    finally:
        patcher.revert()
