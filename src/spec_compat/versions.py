"""Parse vLLM / speculators version strings, including nightlies and source builds.

Version numbers are documentation and hints here; adapters decide by feature probes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

_CUDA_LOCAL = re.compile(r"^(cu|rocm|cpu|xpu|hpu|tpu|neuron)\d*$")
_GIT_LOCAL = re.compile(r"^g([0-9a-f]{6,40})$")


@dataclass(frozen=True)
class ParsedVersion:
    raw: str
    version: Version | None
    kind: str  # "release", "rc", "dev", "source", "unknown"
    release: tuple[int, ...]
    git_sha: str | None
    accelerator: str | None

    @property
    def is_known(self) -> bool:
        return self.version is not None

    def describe(self) -> str:
        parts = [self.raw, self.kind]
        if self.git_sha:
            parts.append(f"git {self.git_sha}")
        if self.accelerator:
            parts.append(self.accelerator)
        return " / ".join(parts)


def parse_version(raw: str | None) -> ParsedVersion:
    """Classify a version string such as ``0.16.0rc2.dev123+g1a2b3c.cu129`` or ``dev``."""
    text = (raw or "").strip()
    try:
        version = Version(text)
    except InvalidVersion:
        return ParsedVersion(text, None, "unknown", (), None, None)

    git_sha: str | None = None
    accelerator: str | None = None
    for segment in (version.local or "").split("."):
        if match := _GIT_LOCAL.match(segment):
            git_sha = match.group(1)
        elif _CUDA_LOCAL.match(segment):
            accelerator = segment

    # setuptools-scm gives a checkout without tags "0.1.devN+gSHA": the number says nothing.
    if version.release[:2] == (0, 1) and version.dev is not None and git_sha:
        kind = "source"
    elif version.dev is not None:
        kind = "dev"
    elif version.pre is not None:
        kind = "rc"
    else:
        kind = "release"
    return ParsedVersion(text, version, kind, version.release, git_sha, accelerator)


def at_least(parsed: ParsedVersion, minimum: str) -> bool | None:
    """Whether ``parsed`` carries the code of release ``minimum``; None when unknowable.

    A nightly of 0.17.0 (``0.17.0rc1.devN``) is built from main after 0.16 branched, so it is
    compared on its release tuple, not with PEP 440 pre-release ordering.
    """
    if parsed.version is None or parsed.kind == "source":
        return None
    return parsed.release >= Version(minimum).release
