"""The result of an adapter's feature probe."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Probe:
    applies: bool
    reason: str
    # True when the break exists but this adapter cannot repair it (apply(strict=True) raises).
    blocking: bool = False
