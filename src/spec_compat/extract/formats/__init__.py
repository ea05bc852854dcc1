"""Output formats: what a sample's file holds and where it goes, behind one small interface.

A format is one module here with one class implementing ``Format``, listed in ``FORMATS``; the
batching, the writer threads, the manifest, resume and ``--replicas`` are the same for every format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..config import ExtractConfig, ExtractError, ModelFacts, Sample
from .hs import SpeculatorsHs
from .v1 import SpeculatorsV1


class Format(Protocol):
    """How one ``--format`` lays out the output directory."""

    name: str  # the --format value
    manifest_format: str  # manifest.json's provenance "format" (a rerun must match it)
    save_label: str  # the spec_compat.timings() label of ``save``
    fp8: bool  # --save-dtype fp8: states stored as float8_e4m3fn with per-token scales

    @classmethod
    def from_config(cls, config: ExtractConfig) -> Format:
        """The format as ``config`` asks for it (--save-dtype, --layer-ids)."""

    def check(self, config: ExtractConfig, facts: ModelFacts) -> None:
        """Refuse (ExtractError) what this format cannot hold, before anything loads."""

    def prepare(self, output: Path, samples: list[Sample], limit: int, sync: bool) -> None:
        """Before the engine: what the output needs besides the samples' files (folders, an index)."""

    def file_name(self, idx: int, row: int | None) -> str:
        """The sample's file, relative to the output (``row``: its place in this shard's samples)."""

    def save(self, payload: dict[str, Any], path: Path) -> dict[str, Any] | None:
        """Write the sample to ``path`` (on a writer thread); what the manifest lists with it, if anything.

        ``payload`` is extract's: ``input_ids`` [seq_len] long, ``hidden_states`` (one [seq_len,
        hidden] tensor per layer id, in the save dtype; bf16 when fp8) and ``loss_mask`` [seq_len] long."""

    def provenance(self, config: ExtractConfig) -> dict[str, Any]:
        """Fields this format adds to manifest.json's provenance (none for speculators-v1)."""


# --format's choices, the default first; a new format: its module, and its class here
FORMATS: dict[str, type[Any]] = {SpeculatorsV1.name: SpeculatorsV1, SpeculatorsHs.name: SpeculatorsHs}


def get(config: ExtractConfig) -> Format:
    """The format ``config`` asks for (--format, --save-dtype)."""
    try:
        cls = FORMATS[config.format]
    except KeyError:
        raise ExtractError(f"--format {config.format}: not one of {', '.join(FORMATS)}") from None
    fmt: Format = cls.from_config(config)
    return fmt


def state_dtype(config: ExtractConfig) -> Any:
    """The torch dtype the payload's states are cast to (fp8 quantizes from bf16 on the writer thread)."""
    import torch

    return torch.bfloat16 if config.save_dtype == "fp8" else getattr(torch, config.save_dtype)
