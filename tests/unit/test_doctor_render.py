"""doctor's text report: the registry's notes under each applied adapter with --explain."""

from __future__ import annotations

from spec_compat import doctor
from spec_compat.registry import BY_ID


def test_explain_renders_the_registry_notes_of_applied_adapters_only() -> None:
    decisions = [
        {"id": "layer-ids", "side": "driver", "applies": True, "reason": "r1", "blocking": False},
        {"id": "input-order", "side": "driver", "applies": False, "reason": "r2", "blocking": False},
    ]
    result = {"verdict": "compatible", "adapters": [doctor._with_registry_notes(d) for d in decisions]}
    plain = doctor.render(result)
    assert "why:" not in plain
    explained = doctor.render(result, explain=True)
    layer_ids = BY_ID["layer-ids"]
    assert f"      why:         {layer_ids.why}" in explained
    assert f"      delete when: {layer_ids.delete_when}" in explained
    assert f"      vLLM change: {layer_ids.vllm_change}" in explained
    assert BY_ID["input-order"].why not in explained  # not applied: no notes
