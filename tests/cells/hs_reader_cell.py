"""speculators >= 0.5's own reader on ``spec-compat extract --format speculators-hs`` outputs (run by
test_extract.py in a fresh interpreter with the speculators 0.9.0 reader install first on PYTHONPATH,
no spec_compat imported): what its training dataset returns for every row, saved for the test to
compare with the speculators-v1 files.

    python hs_reader_cell.py SPEC.json OUT.pt

SPEC: {"outputs": {name: {"path": dir, "backend": "file" | "fp8"}}, "max_len": N}. OUT: {"versions",
"unmet" (requirements of speculators / hs-connectors / datasets the environment does not meet),
name: {"rows": {row: item}, "existing", "corrupt", "checked", "collated"}}.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import sys
from pathlib import Path
from typing import Any


def unmet_requirements(distributions: list[str]) -> list[str]:
    """Each ``Requires-Dist`` (no extra) of ``distributions`` that the importable versions do not meet."""
    from packaging.requirements import Requirement

    unmet = []
    for name in distributions:
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                version = metadata.version(requirement.name)
            except metadata.PackageNotFoundError:
                unmet.append(f"{name}: {line} (not installed)")
                continue
            if not requirement.specifier.contains(version, prereleases=True):
                unmet.append(f"{name}: {line} (have {version})")
    return unmet


def read_output(path: Path, backend: str, max_len: int) -> dict[str, Any]:
    import torch
    from hs_connectors import HiddenStatesBackend
    from speculators.data_generation.offline import (
        check_hidden_states,
        find_corrupt_hidden_state_indices,
        get_existing_hidden_state_indices,
    )
    from speculators.train.data import ArrowDataset, CollateFn

    # as speculators' train CLI builds it (train/cli.py: backend_cls.from_train_args(args, args.data_path))
    transfer = HiddenStatesBackend.registry[backend].from_train_args(
        argparse.Namespace(hidden_states_path=None), str(path)
    )
    dataset = ArrowDataset(max_len=max_len, datapath=str(path), transfer=transfer, on_missing="raise")
    rows = {}
    for row in range(len(dataset)):
        item = dataset[row]
        if not isinstance(item, dict):  # SampleUnavailable: its token ids do not match the row's
            rows[row] = {"unavailable": getattr(item, "reason", repr(item))}
            continue
        rows[row] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in item.items()}
    hidden = path / "hidden_states"
    existing = get_existing_hidden_state_indices(hidden)
    checked = 0
    for row in existing:  # the check ArrowDataset makes of a sample it generates, on what the transfer returns
        # (dequantized: speculators' check_hidden_states takes no float8 on CPU, torch.aminmax refuses it)
        check_hidden_states(transfer.get_cached(row), dataset.data[row]["input_ids"].tolist())
        checked += 1
    first = next(v for v in rows.values() if "unavailable" not in v)
    layers = first["hidden_states"].shape[-1] // first["verifier_last_hidden_states"].shape[-1]
    collate = CollateFn(max_len, first["verifier_last_hidden_states"].shape[-1], num_target_layers=layers)
    batch = collate([rows[r] for r in sorted(rows) if "unavailable" not in rows[r]][:4])
    return {
        "rows": rows,
        "existing": existing,
        "corrupt": find_corrupt_hidden_state_indices(hidden, existing),
        "checked": checked,
        "collated": {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)},
    }


def main(spec_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {
        "versions": {name: metadata.version(name) for name in ("speculators", "hs-connectors", "datasets")},
        "unmet": unmet_requirements(["speculators", "hs-connectors", "datasets"]),
        "spec_compat_imported": "spec_compat" in sys.modules,
    }
    for name, output in spec["outputs"].items():
        result[name] = read_output(Path(output["path"]), output["backend"], spec["max_len"])
    result["spec_compat_imported"] = result["spec_compat_imported"] or "spec_compat" in sys.modules
    torch.save(result, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
