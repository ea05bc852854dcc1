"""``spec-compat doctor``: is this environment compatible? Loads no model.

Gives the same answer as ``apply(strict=True)``: it runs apply() (probes, adapters, preflight)
in this short-lived process and reverts it before returning.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict
from typing import Any

EXIT_COMPATIBLE = 0
EXIT_INCOMPATIBLE = 1
EXIT_UNKNOWN = 2


def model_runner(decisions: dict[str, Any], platform: str) -> str:
    v1 = decisions.get("executor-model-runner-v1")
    if platform == "cpu":
        return "CPUModelRunner (vLLM's V1 runner for CPU)"
    if v1 is not None and v1.applies:
        return "V1 GPUModelRunner (spec_compat sets VLLM_USE_V2_MODEL_RUNNER=0 while the workers start, if unset)"
    return "vLLM's default (this vLLM has no Model Runner V2 switch)"


def _with_registry_notes(decision: dict[str, Any]) -> dict[str, Any]:
    """The adapter's record beside the decision: the file that defines it, what it patches (dotted
    paths) and how, why, the vLLM change behind it, and when it can be deleted (each unit in its
    adapter file is the single source; registry.py lists them)."""
    from .registry import BY_ID, adapter_file

    adapter = BY_ID.get(decision["id"])
    if adapter is None:
        return decision
    notes: dict[str, Any] = {k: str(getattr(adapter, k)) for k in ("how", "why", "vllm_change", "delete_when")}
    if adapter.first_seen_nightly:
        notes["vllm_change"] += f"; first seen in nightly {adapter.first_seen_nightly}"
    if adapter.changes_seen_in_nightly:  # "<change>: <build>", each dated by the builds' source
        found = (seen.rpartition(": ") for seen in adapter.changes_seen_in_nightly)
        notes["vllm_change"] += "; first seen in nightly, by source: " + "; ".join(f"{c} in {b}" for c, _, b in found)
    notes |= {"file": adapter_file(adapter.id), "patches": list(adapter.patches)}
    notes["speculators"] = str(adapter.speculators)
    return {**decision, **notes}


def cpu_amx_section(options: Any) -> dict[str, Any] | None:
    """Which of vLLM's CPU paths need bfloat16 or may trap on this AMX host, and the way out
    (adapters/cpu_amx.py; None without AMX). A failed check is reported, never raised."""
    from .adapters import cpu_amx

    try:
        return cpu_amx.amx_check(options)
    except Exception as exc:  # noqa: BLE001 - the rest of the report stands
        return {"error": f"{type(exc).__name__}: {exc}"}


def render_cpu_amx(section: dict[str, Any]) -> list[str]:
    if "error" in section:
        return [f"cpu AMX: check failed: {section['error']}"]
    flags = ", ".join(section["advertised"]) or "amx_tile"
    lines = [f"cpu AMX: this CPU advertises {flags}; vLLM picks AMX-only kernels for some paths"]
    lines.append(f"  kernel: {section['kernel']}")
    lines.extend(f"  {what:24s} {line}" for what, line in section["paths"].items())
    lines.extend(f"  way out: {line}" for line in section["way_out"])
    return lines


def diagnose() -> tuple[int, dict[str, Any]]:
    import spec_compat

    try:
        report = spec_compat.apply()
    except Exception as exc:  # noqa: BLE001 - "could not tell" is an answer too
        return EXIT_UNKNOWN, {
            "verdict": "could not tell",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    try:
        decisions = {d.id: d for d in report.decisions}
        failed_probes = [d.id for d in report.decisions if d.reason.startswith("probe failed")]
        if failed_probes:
            code, verdict = EXIT_UNKNOWN, f"could not tell: probes failed for {failed_probes}"
        elif report.ok:
            code, verdict = EXIT_COMPATIBLE, "compatible"
        else:
            code, verdict = EXIT_INCOMPATIBLE, "incompatible"
        result: dict[str, Any] = {
            "verdict": verdict,
            "environment": report.env.as_dict(),
            "adapters": [_with_registry_notes(asdict(d)) for d in report.decisions],
            "preflight": [asdict(f) for f in report.preflight],
            "problems": report.problems,
            "model_runner": model_runner(decisions, report.env.platform),
        }
        if report.env.platform == "cpu":
            result["cpu_amx"] = cpu_amx_section(report.options)
    finally:
        spec_compat.revert()
    return code, result


def render(result: dict[str, Any], explain: bool = False) -> str:
    """The report as text; ``explain`` adds, under every adapter that applies, its registry notes."""
    lines: list[str] = []
    env = result.get("environment")
    if env:
        lines.append("environment")
        lines.extend(f"  {key:24s} {value}" for key, value in env.items() if key != "notes")
        lines.extend(f"  note: {note}" for note in env.get("notes", []))
    if result.get("adapters"):
        lines.append("adapters")
        for adapter in result["adapters"]:
            mark = "applies" if adapter["applies"] else ("BLOCKS" if adapter["blocking"] else "-")
            lines.append(f"  {adapter['id']:34s} {mark:8s} {adapter['reason']}")
            if explain and adapter["applies"] and "why" in adapter:
                how = f" ({adapter['how']})" if adapter.get("how") else ""
                lines.append(f"      file:        {adapter['file']}")
                lines.append(f"      patches:     {', '.join(adapter['patches'])}{how}")
                lines.append(f"      why:         {adapter['why']}")
                lines.append(f"      vLLM change: {adapter['vllm_change']}")
                lines.append(f"      delete when: {adapter['delete_when']}")
    if result.get("preflight"):
        bad = [f for f in result["preflight"] if not f["ok"]]
        lines.append(f"preflight: {len(result['preflight']) - len(bad)}/{len(result['preflight'])} calls bind")
        lines.extend(f"  FAIL {f['what']}: {f['detail']}" for f in bad)
    if result.get("model_runner"):
        lines.append(f"model runner: {result['model_runner']}")
    if result.get("cpu_amx"):
        lines.extend(render_cpu_amx(result["cpu_amx"]))
    for problem in result.get("problems", []):
        lines.append(f"problem: {problem}")
    if result.get("error"):
        lines.append(f"error: {result['error']}")
    lines.append(f"verdict: {result['verdict']}")
    return "\n".join(lines)


def run(as_json: bool, explain: bool = False) -> int:
    code, result = diagnose()
    result["exit_code"] = code
    print(json.dumps(result, indent=2, default=str) if as_json else render(result, explain))
    return code
