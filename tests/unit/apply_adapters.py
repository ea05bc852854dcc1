"""Probe and apply a chosen list of registry adapters, as apply() does, on fake modules."""

from __future__ import annotations

from collections.abc import Iterable

from spec_compat.options import Context
from spec_compat.patching import Patcher
from spec_compat.registry import BY_ID


def apply_adapters(ctx: Context, adapter_ids: Iterable[str]) -> tuple[Patcher, list[str]]:
    patcher = Patcher()
    applied = []
    for adapter_id in adapter_ids:
        if BY_ID[adapter_id].probe(ctx).applies:
            BY_ID[adapter_id].install(ctx, patcher)
            applied.append(adapter_id)
    return patcher, applied
