"""doctor's text report: the registry's notes under each applied adapter with --explain; the AMX check
(adapters/cpu_amx.py) with its probe and vLLM look-ups replaced, so no engine and no child process."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

import pytest

from spec_compat import doctor
from spec_compat.adapters import cpu_amx
from spec_compat.options import Options
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
    assert "      file:        adapters/driver/layer_ids.py" in explained  # the id names its file
    assert f"      patches:     {', '.join(layer_ids.patches)} ({layer_ids.how})" in explained
    assert BY_ID["input-order"].why not in explained  # not applied: no notes


AMX_SECTION = {
    "advertised": ["amx_tile", "amx_bf16"],
    "kernel": "vLLM's bfloat16 AMX kernels die with SIGILL ...",
    "probe": {"bare": "traps", "after_request": "runs"},
    "paths": {
        "MLA attention": "vLLM picks AMX_MLA (bfloat16 only) ...",
        "fused MoE": "bfloat16: X86CPUUnquantizedExperts",
    },
    "way_out": ["float32 MLA model: SPEC_COMPAT_ATTENTION_BACKEND=CPU_MLA (...)"],
}


def test_cpu_amx_section_names_the_paths_and_the_way_out() -> None:
    text = doctor.render({"verdict": "compatible", "model_runner": "CPUModelRunner", "cpu_amx": AMX_SECTION})
    lines = text.splitlines()
    start = lines.index("cpu AMX: this CPU advertises amx_tile, amx_bf16; vLLM picks AMX-only kernels for some paths")
    assert lines[start - 1] == "model runner: CPUModelRunner" and lines[-1] == "verdict: compatible"
    assert lines[start + 1] == f"  kernel: {AMX_SECTION['kernel']}"
    assert f"  {'MLA attention':24s} vLLM picks AMX_MLA (bfloat16 only) ..." in lines
    assert f"  {'fused MoE':24s} bfloat16: X86CPUUnquantizedExperts" in lines
    assert "  way out: float32 MLA model: SPEC_COMPAT_ATTENTION_BACKEND=CPU_MLA (...)" in lines


def test_no_amx_section_without_amx_and_a_failed_check_is_one_line() -> None:
    assert "cpu AMX" not in doctor.render({"verdict": "compatible", "cpu_amx": None})
    failed = doctor.render({"verdict": "compatible", "cpu_amx": {"error": "ImportError: x"}})
    assert "cpu AMX: check failed: ImportError: x" in failed.splitlines()


def test_cpu_amx_check_asks_again_only_after_a_trap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_amx, "vllm_sees_amx", lambda: True)
    monkeypatch.setattr(cpu_amx, "advertised_flags", lambda: ["amx_tile"])
    backends = {None: ("AMX_MLA", ["bfloat16"], False), "CPU_MLA": ("CPU_MLA", ["bfloat16", "float32"], True)}
    monkeypatch.setattr(cpu_amx, "mla_backend", lambda dtype, requested=None: backends[requested])
    monkeypatch.setattr(cpu_amx, "moe_experts", lambda: "bfloat16: AMX")
    monkeypatch.setattr(cpu_amx, "attention_isa", lambda: None)
    modes: list[str] = []

    def trapping(mode: str) -> str:
        modes.append(mode)
        return "traps" if mode == "bare" else "runs"

    section = cpu_amx.amx_check(Options(), run=trapping)
    assert section is not None and modes == ["bare", "request"]
    assert section["probe"] == {"bare": "traps", "after_request": "runs"}
    assert "has not asked Linux for the AMX state" in section["kernel"]
    assert set(section["paths"]) == {"MLA attention", "fused MoE"} and "AMX_MLA" in section["paths"]["MLA attention"]
    assert section["way_out"][0].startswith("float32 MLA model: SPEC_COMPAT_ATTENTION_BACKEND=CPU_MLA (vLLM's")
    assert section["way_out"][1].startswith("if a bfloat16 run dies with SIGILL: run float32 (SPEC_COMPAT_DTYPE")
    chosen = cpu_amx.amx_check(Options(dtype="float32", attention_backend="CPU_MLA"), run=lambda mode: "traps")
    assert chosen is not None and "CPU_MLA (set)" in chosen["way_out"][0]
    assert "(dtype float32 set)" in chosen["way_out"][1]
    assert "not usable" in chosen["kernel"] and chosen["way_out"][1].startswith("bfloat16 MoE / MLA / attention trap")
    modes.clear()
    fine = cpu_amx.amx_check(Options(), run=lambda mode: modes.append(mode) or "runs")
    assert fine is not None and modes == ["bare"] and fine["probe"]["after_request"] is None
    assert len(fine["way_out"]) == 1 and "runs here" in fine["kernel"]
    monkeypatch.setattr(cpu_amx, "vllm_sees_amx", lambda: False)
    assert cpu_amx.amx_check(Options(), run=lambda mode: pytest.fail("probed without AMX")) is None


@pytest.mark.parametrize(
    ("returncode", "outcome"),
    [(0, "runs"), (-signal.SIGILL, "traps"), (cpu_amx.NO_KERNEL_EXIT, "no kernel"), (1, "failed: ValueError: bad")],
)
def test_probe_outcome_is_read_from_the_child_exit(
    monkeypatch: pytest.MonkeyPatch, returncode: int, outcome: str
) -> None:
    calls: list[list[str]] = []

    def child(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        assert kwargs["timeout"] == cpu_amx.PROBE_TIMEOUT_S and kwargs["capture_output"]
        return subprocess.CompletedProcess(args, returncode, "", "Traceback\nValueError: bad\n")

    monkeypatch.setattr(cpu_amx.subprocess, "run", child)
    assert cpu_amx.run_probe("bare") == outcome
    assert calls[0][1:] == ["-c", cpu_amx.PROBE_CODE, "bare"]


def test_probe_timeout_and_a_raising_check_are_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(args: list[str], **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired(args, kwargs["timeout"])

    monkeypatch.setattr(cpu_amx.subprocess, "run", slow)
    assert cpu_amx.run_probe("bare") == "timeout"
    assert "did not finish" in cpu_amx.kernel_verdict("timeout", None)

    def broken(options: Any) -> Any:
        raise RuntimeError("no vLLM")

    monkeypatch.setattr(cpu_amx, "amx_check", broken)
    assert doctor.cpu_amx_section(Options()) == {"error": "RuntimeError: no vLLM"}
