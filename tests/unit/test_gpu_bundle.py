"""tools/gpu_bundle.py without downloads: the release bundles' staged folder names, that staging one
bundle never removes another's folders, and the closure check over (release) + (0.22.1 bundle)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import gpu_bundle
import pytest


def make_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n\n")
    return path


def test_stage_names() -> None:
    parts = [{"name": f"x.part0{i}"} for i in range(3)]
    assert gpu_bundle.stage_names({"parts": parts}) == ["p0", "p1", "p2"]
    assert gpu_bundle.stage_names({"parts": parts[:1], "release": "0.23.0"}) == ["r0.23.0"]
    assert gpu_bundle.stage_names({"parts": parts, "release": "0.23.0"}) == ["r0.23.0a", "r0.23.0b", "r0.23.0c"]


def test_stage_clear_touches_only_its_own_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_bundle, "STAGE_DIR", tmp_path)
    names = ["p0", "p1", "r0.23.0", "r0.23.0a", "r0.23.0b", "r0.24.0a", "r0.23.01a", "other"]
    for name in names:
        (tmp_path / name).mkdir()
    gpu_bundle.stage_clear("0.23.0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "p0", "p1", "r0.23.01a", "r0.24.0a"]
    gpu_bundle.stage_clear(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "r0.23.01a", "r0.24.0a"]


def test_release_closure_shadows_the_base(tmp_path: Path) -> None:
    base = [
        make_wheel(tmp_path, "vllm", "0.22.1", ["fastapi>=0.115", "compressed-tensors==0.15.0.1"]),
        make_wheel(tmp_path, "fastapi", "0.165.0", ["starlette>=0.46"]),
        make_wheel(tmp_path, "starlette", "1.10.0", []),
        make_wheel(tmp_path, "compressed-tensors", "0.15.0.1", []),
        make_wheel(tmp_path, "sse-starlette", "3.7.0", ["starlette>=0.49"]),
    ]
    release_dir = tmp_path / "release"
    release_dir.mkdir()
    vllm = make_wheel(
        release_dir,
        "vllm",
        "0.23.0",
        ["fastapi<0.137,>=0.115", "compressed-tensors==0.17.0", "humming-kernels==0.1.4", "torchcodec>=0.14"],
    )
    fastapi = make_wheel(release_dir, "fastapi", "0.136.3", ["starlette>=0.46.0"])
    ct = make_wheel(release_dir, "compressed-tensors", "0.17.0", ["torch>=2.10.0"])
    humming = make_wheel(release_dir, "humming-kernels", "0.1.4", ["pyelftools"])
    not_carried = {"torchcodec": "lazy"}

    # without humming's pyelftools anywhere: missing; the base's old versions never count
    closure = gpu_bundle.closure_report([vllm, fastapi, ct, humming], [], base=base, not_carried=not_carried)
    assert closure.missing == ["humming-kernels -> pyelftools"]
    assert not closure.conflicts
    assert sorted(closure.shadows_base) == [
        "compressed-tensors 0.15.0.1 -> 0.17.0",
        "fastapi 0.165.0 -> 0.136.3",
        "vllm 0.22.1 -> 0.23.0",
    ]
    assert closure.not_carried == ["vllm -> torchcodec>=0.14 (lazy)"]

    elf = make_wheel(release_dir, "pyelftools", "0.33", [])
    closure = gpu_bundle.closure_report([vllm, fastapi, ct, humming, elf], [], base=base, not_carried=not_carried)
    assert closure.ok

    # the base's fastapi would not do: a conflict if the release did not carry its own
    closure = gpu_bundle.closure_report([vllm, ct, humming, elf], [], base=base, not_carried=not_carried)
    assert closure.conflicts == ["vllm -> fastapi<0.137,>=0.115: carried 0.165.0"]


def test_releases_carry_their_humming() -> None:
    for version, specs in gpu_bundle.RELEASES.items():
        names = {gpu_bundle.pin(s)[0] for s in specs}
        assert {"compressed-tensors", "humming-kernels", "pyelftools"} <= names, version
        assert not names & set(gpu_bundle.RELEASE_NOT_CARRIED), version
