"""One speculators version's view of a conversations file (run by test_conversations.py in a fresh
interpreter with that speculators on PYTHONPATH): spec_compat's ``conversation_samples`` and
speculators' own ``load_and_preprocess_dataset`` on the same file (bad lines removed), as JSON.

    python conversations_cell.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work"])
    result: dict[str, Any] = {}
    from spec_compat.extract import ExtractConfig

    try:
        from spec_compat.extract.conversations import conversation_samples

        runs = {}
        for shard in spec.get("shards", [[0, 1]]):
            config = ExtractConfig(
                model=spec["model"], input=Path(spec["input"]), output=work / "out", layer_ids=[0],
                max_model_len=spec["max_model_len"], shard=(shard[0], shard[1]), conversations=True,
                seed=spec["seed"], on_error=spec.get("on_error", "skip"),
            )  # fmt: skip
            samples, bad = conversation_samples(config)
            runs[f"{shard[0]}/{shard[1]}"] = {
                "samples": [[s.idx, s.input_ids, s.loss_mask] for s in samples],
                "bad": [[b.line, b.reason] for b in bad],
            }
        result["runs"] = runs
    except ValueError as exc:
        result["error"] = str(exc)
        Path(out_path).write_text(json.dumps(result))
        return
    import torch

    freq = work / "out" / "token_freq.pt"
    result["token_freq"] = sorted(torch.load(freq).items()) if freq.exists() else None
    result["output_exists"] = (work / "out").exists()
    if spec.get("reference"):
        from speculators.data_generation.preprocessing import load_and_preprocess_dataset

        dataset, _ = load_and_preprocess_dataset(
            target_model_path=spec["model"], train_data_path=spec["reference"], seq_length=spec["max_model_len"],
            build_dataset_num_proc=1, seed=spec["seed"], token_freq_path=str(work / "reference_freq.pt"),
            cache_dir=str(work / "reference_cache"),
        )  # fmt: skip
        result["reference"] = [[row["input_ids"].tolist(), row["loss_mask"].tolist()] for row in dataset]
        result["reference_token_freq"] = sorted(torch.load(work / "reference_freq.pt").items())
    result["cwd_files"] = sorted(os.listdir("."))
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
