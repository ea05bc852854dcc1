"""``--format speculators-v1`` (the default): speculators 0.3 / 0.4's ``data_{idx}.pt``.

What its ``Eagle3SampleFileDataset`` reads (speculators 0.4.0.1 ``speculators/train/data.py``: the
file's ``hidden_states`` list, all but the last concatenated, the last as the verifier's): one
``torch.save`` file per sample holding ``input_ids`` [seq_len] long, ``hidden_states`` (a list of
[seq_len, hidden] tensors, one per layer id) and ``loss_mask`` [seq_len] long, plus
``sample_lengths.json``. With fp8 the list holds float8_e4m3fn tensors and the file one more key,
``hidden_states_scales`` [seq_len, 1] float32 (one scale per token, shared by its layers); that
speculators' dataset casts states without scales, so fp8 files are read through
``spec_compat.extract.fp8.load_v1`` (docs/extract.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import FORMAT, ExtractConfig, ModelFacts, Sample
from ..fp8 import SCALES, quantize_layers


class SpeculatorsV1:
    name = "speculators-v1"
    manifest_format = FORMAT
    save_label = "extract:torch-save"

    def __init__(self, fp8: bool = False) -> None:
        self.fp8 = fp8

    @classmethod
    def from_config(cls, config: ExtractConfig) -> SpeculatorsV1:
        return cls(fp8=config.save_dtype == "fp8")

    def check(self, config: ExtractConfig, facts: ModelFacts) -> None:
        return None

    def prepare(self, output: Path, samples: list[Sample], limit: int, sync: bool) -> None:
        return None

    def file_name(self, idx: int, row: int | None) -> str:
        return f"data_{idx}.pt"

    def save(self, payload: dict[str, Any], path: Path) -> dict[str, Any] | None:
        # torch.save to a path writes the tensor bytes from C++ without the GIL (through a Python
        # file object every tensor was copied into a bytes object under it: 0.79x on an H200)
        import torch

        if not self.fp8:
            torch.save(payload, path)
            return None
        layers, scale, error = quantize_layers(payload["hidden_states"])
        torch.save({**payload, "hidden_states": layers, SCALES: scale}, path)
        return {"fp8": error}

    def provenance(self, config: ExtractConfig) -> dict[str, Any]:
        return {}
