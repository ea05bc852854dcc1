"""Worker-side adapters against speculators 0.3.0- and 0.4.x-style worker code, and against models
with the old (get_input_embeddings) and new (embed_input_ids) embedding names."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spec_compat.adapters.remote_errors import EncodedWorkerException, decode
from spec_compat.detect import detect
from spec_compat.options import Context, Options
from spec_compat.patching import Patcher
from tests.unit.apply_adapters import apply_adapters
from tests.unit.fake_worker import fake_worker

WORKER_ADAPTERS = ["capture-gate", "capture-setup", "layer-kwargs", "batch-order-log", "loud-worker-errors"]


class Layer:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> Any:
        return self.forward(**kwargs)

    def forward(self, hidden_states: Any, positions: Any, residual: Any, t_cond: Any = None) -> Any:
        self.seen.append({"t_cond": t_cond})
        return hidden_states + 1, residual


class BaseModel:
    def __init__(self) -> None:
        self.layers = [Layer(), Layer()]
        self.start_layer, self.end_layer = 0, 2

    def named_modules(self) -> list[tuple[str, Any]]:
        return []


class NewBase(BaseModel):  # vLLM >= 0.11.2
    def embed_input_ids(self, input_ids: Any) -> Any:
        return input_ids * 10


class OldBase(BaseModel):  # vLLM <= 0.11.0
    def get_input_embeddings(self, input_ids: Any) -> Any:
        return input_ids * 10


def _worker_with_adapters(tmp_path: Path, style: str) -> tuple[Any, Patcher, list[str]]:
    module = fake_worker(tmp_path, style)
    patcher, applied = apply_adapters(Context(env=detect(), options=Options(), worker=module), WORKER_ADAPTERS)
    return module, patcher, applied


def _extension(module: Any, base: Any, with_input_batch: bool = True) -> Any:
    extension = module.HiddenStatesWorkerExtension()
    runner = SimpleNamespace(
        model=SimpleNamespace(model=base), model_config=SimpleNamespace(hf_config=SimpleNamespace())
    )
    if with_input_batch:
        runner.input_batch = SimpleNamespace(req_ids=["b", "a", None], num_reqs=2, req_id_to_index={"b": 0, "a": 1})
    extension.model_runner = runner
    return extension


@pytest.mark.parametrize("style", ["0.3", "0.4"])
@pytest.mark.parametrize("base_cls", [NewBase, OldBase], ids=["embed_input_ids", "get_input_embeddings"])
def test_capture_runs_with_either_embedding_name(tmp_path: Path, style: str, base_cls: type) -> None:
    module, patcher, _ = _worker_with_adapters(tmp_path, style)
    try:
        base = base_cls()
        extension = _extension(module, base)
        extension._setup_hidden_states_capture([0])
        assert base.forward(3, positions=None) == 32  # embedding 30, two layers +1
    finally:
        patcher.revert()


def test_without_adapters_the_rename_breaks(tmp_path: Path) -> None:
    module = fake_worker(tmp_path, "0.3")
    base = NewBase()
    model = SimpleNamespace(model=base, declares_eagle3=True)
    extension = module.HiddenStatesWorkerExtension()
    extension.model_runner = SimpleNamespace(model=model)
    extension._setup_hidden_states_capture([0])
    with pytest.raises(AttributeError):
        base.forward(3, positions=None)


def test_capture_gate_accepts_models_with_layers_only(tmp_path: Path) -> None:
    module, patcher, applied = _worker_with_adapters(tmp_path, "0.3")
    try:
        assert "capture-gate" in applied
        assert module.supports_eagle3(SimpleNamespace(model=NewBase()))
        assert not module.supports_eagle3(SimpleNamespace(model=SimpleNamespace()))
    finally:
        patcher.revert()
    _, patcher04, applied04 = _worker_with_adapters(tmp_path, "0.4")
    patcher04.revert()
    assert "capture-gate" not in applied04


def test_layer_kwargs_reach_layers_for_one_forward(tmp_path: Path) -> None:
    module, patcher, _ = _worker_with_adapters(tmp_path, "0.4")
    try:
        base = NewBase()
        _extension(module, base)._setup_hidden_states_capture([0])
        base.forward(1, positions=None, t_cond="cond", unrelated=None)
        assert [layer.seen[-1]["t_cond"] for layer in base.layers] == ["cond", "cond"]
        assert all("forward" not in vars(layer) for layer in base.layers)  # only for that forward
        with pytest.warns(UserWarning, match="not decoder-layer keywords"):
            base.forward(1, positions=None, deepstack="x")
    finally:
        patcher.revert()


def test_v2_runner_is_refused_at_setup(tmp_path: Path) -> None:
    module, patcher, _ = _worker_with_adapters(tmp_path, "0.4")
    try:
        extension = _extension(module, NewBase(), with_input_batch=False)
        with pytest.raises(EncodedWorkerException) as info:
            extension._setup_hidden_states_capture([0])
        decoded = decode(str(info.value))
        assert (
            decoded is not None and decoded.exc_type == "NotImplementedError" and "Model Runner V2" in decoded.message
        )
    finally:
        patcher.revert()


def test_llama4_scaling_is_refused(tmp_path: Path) -> None:
    module, patcher, _ = _worker_with_adapters(tmp_path, "0.4")
    try:
        extension = _extension(module, NewBase())
        extension.model_runner.model_config.hf_config.llama_4_scaling = {"beta": 0.1}
        with pytest.raises(EncodedWorkerException, match="llama_4_scaling"):
            extension._setup_hidden_states_capture([0])
    finally:
        patcher.revert()


def test_loud_errors_carry_type_and_traceback(tmp_path: Path) -> None:
    module, patcher, _ = _worker_with_adapters(tmp_path, "0.3")
    try:
        with pytest.raises(EncodedWorkerException) as info:
            module.HiddenStatesWorkerExtension()._fail_empty()
        decoded = decode(str(info.value))
        assert decoded is not None
        assert (decoded.exc_type, decoded.message, decoded.method) == ("AssertionError", "", "_fail_empty")
        assert "_fail_empty" in decoded.remote_traceback
    finally:
        patcher.revert()


def test_batch_order_log_records_runner_order(tmp_path: Path) -> None:
    module, patcher, applied = _worker_with_adapters(tmp_path, "0.3")
    try:
        assert "batch-order-log" in applied
        extension = _extension(module, NewBase())
        extension._store_captured_states(["h"])
        assert extension._spec_compat_take_batch_log() == [["b", "a"]]
        assert extension._spec_compat_take_batch_log() == []
    finally:
        patcher.revert()
    assert not hasattr(module.HiddenStatesWorkerExtension, "_spec_compat_take_batch_log")


def test_batch_order_unverifiable_without_input_batch(tmp_path: Path) -> None:
    module, patcher, _ = _worker_with_adapters(tmp_path, "0.3")
    try:
        extension = _extension(module, NewBase(), with_input_batch=False)
        with pytest.raises(EncodedWorkerException, match="cannot be verified"):
            extension._store_captured_states(["h"])
    finally:
        patcher.revert()
