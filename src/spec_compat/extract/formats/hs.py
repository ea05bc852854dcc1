"""``--format speculators-hs``: the layout speculators >= 0.5's offline pipeline writes and trains from.

Read from speculators 0.9.0 and hs-connectors 0.9.0 (the wheels on PyPI):

- the output directory is a Hugging Face dataset saved with ``save_to_disk`` (``speculators
  prepare-data``, ``speculators/cli/prepare_data.py:243``) with the columns its preprocessing makes
  (``speculators/data_generation/preprocessing.py:397-399`` and ``:638``): ``input_ids`` and
  ``loss_mask`` (lists of int64) and ``seq_len`` (int64), in torch format; its row ``i`` is sample
  ``i``;
- ``hidden_states/hs_{i}.safetensors`` next to it for row ``i`` (``generate-offline-data``'s default
  ``{preprocessed-data}/hidden_states``, ``speculators/cli/generate_offline_data.py:139,268``; the
  trainer's file backend reads ``data_path / "hidden_states" / f"hs_{file_idx}.safetensors"``,
  ``hs_connectors/transfer.py:142,192``), holding what vLLM's ``ExampleHiddenStatesConnector``
  saves (vLLM 0.32 ``example_hidden_states_connector.py:415-418``): ``hidden_states`` [seq_len,
  num_layers, hidden] and ``token_ids`` [seq_len] int64; with fp8 ``hidden_states`` is
  float8_e4m3fn and ``hidden_states_scales`` [seq_len, 1, 1] float32 is added
  (``hs_connectors/fp8_hidden_states_connector.py:33-37,49-56``);
- ``ArrowDataset`` (``speculators/train/data.py:274-333``) maps dataset row ``index`` to file
  ``index`` (plus the split's start), checks the file's ``token_ids`` equal the row's
  ``input_ids``, trains on ``hidden_states[:, :-1]`` flattened and takes ``hidden_states[:, -1]``
  as the verifier's last hidden state, and the row's ``loss_mask``; ``token_freq.pt`` beside the
  dataset is where its trainer looks for token frequencies (``speculators/train/cli.py:361``).

So a file's number is the sample's row among this shard's samples (``Sample.row``: the line order
of the input, blank and skipped lines left out), and the dataset lists every sample of the shard,
its ids and mask cut as the generator cuts them (``max_model_len - 1`` tokens); a sample not (yet)
written is a row without its file, as in speculators' own pipeline before (or after a failure of)
its generation. The manifest keys stay the input's line numbers (``idx``), as in speculators-v1.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..config import ExtractConfig, ExtractError, ModelFacts, Sample
from ..files import fsync_directory
from ..fp8 import SCALES, quantize_layers

HIDDEN_STATES = "hidden_states"  # the folder of the hs files, inside the output (the dataset)
INDEX_TMP = ".spec-compat-dataset.tmp"


class SpeculatorsHs:
    name = "speculators-hs"
    manifest_format = "speculators-hs"
    save_label = "extract:safetensors-save"

    def __init__(self, fp8: bool = False, layer_ids: list[int] | None = None) -> None:
        self.fp8 = fp8
        # the generator returns the states in --layer-ids order; vLLM-native extraction (which
        # speculators >= 0.5's trainer and its inference pair with) in ascending layer order
        ids = list(layer_ids or [])
        self.order = sorted(range(len(ids)), key=ids.__getitem__)

    @classmethod
    def from_config(cls, config: ExtractConfig) -> SpeculatorsHs:
        return cls(fp8=config.save_dtype == "fp8", layer_ids=config.layer_ids)

    def check(self, config: ExtractConfig, facts: ModelFacts) -> None:
        """speculators >= 0.5 trains on every layer but the last (files hold them in ascending layer
        order, as vLLM-native extraction does) and takes the last as the verifier's final hidden
        state: --layer-ids must include the model's last layer. The dataset needs ``datasets``."""
        last = facts.num_layers - 1 if facts.num_layers is not None else None
        if last is not None and max(config.layer_ids) != last:
            raise ExtractError(
                f"--format speculators-hs: --layer-ids {config.layer_ids} must include the model's last layer "
                f"{last} (speculators >= 0.5 trains on the others and takes the last as the verifier's last "
                "hidden state)"
            )
        if len(config.layer_ids) < 2:
            raise ExtractError("--format speculators-hs: needs at least two --layer-ids (the targets and the last)")
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise ExtractError(
                "--format speculators-hs writes a Hugging Face dataset: needs the 'datasets' package"
            ) from None

    def prepare(self, output: Path, samples: list[Sample], limit: int, sync: bool) -> None:
        """hidden_states/ and the dataset of this shard's samples (rewritten by every run: it only
        depends on the input), saved aside and moved into the output file by file."""
        (output / HIDDEN_STATES).mkdir(exist_ok=True)
        write_index(output, samples, limit, sync)

    def file_name(self, idx: int, row: int | None) -> str:
        assert row is not None, "speculators-hs numbers files by row"
        return f"{HIDDEN_STATES}/hs_{row}.safetensors"

    def save(self, payload: dict[str, Any], path: Path) -> dict[str, Any] | None:
        # safetensors (>= 0.8.0, as vLLM's connector asks for) writes without holding the GIL
        import torch
        from safetensors.torch import save_file

        extra: dict[str, Any] | None = None
        layers = payload["hidden_states"]
        if self.order and len(self.order) == len(layers):
            layers = [layers[k] for k in self.order]
        tensors = {"token_ids": payload["input_ids"]}
        if self.fp8:
            layers, scale, error = quantize_layers(layers)
            tensors[SCALES] = scale.unsqueeze(-1)  # [seq_len, 1, 1], the connector's shape
            extra = {"fp8": error}
        tensors["hidden_states"] = torch.stack(layers, dim=1)  # [seq_len, num_layers, hidden]
        save_file(tensors, str(path))
        return extra

    def provenance(self, config: ExtractConfig) -> dict[str, Any]:
        # vLLM-native extraction counts layers from the embeddings (id k = the state after k decoder
        # layers); speculators 0.3 / 0.4's generator's id k is the output of layer k, i.e. native k + 1
        # file_layer_ids: the generator's ids in the files' order (the fp8 error's too); shard: files are
        # numbered by row within the shard, so another shard into the same output is refused (RESUME_KEYS)
        return {
            "file_layer_ids": sorted(config.layer_ids),
            "native_layer_ids": sorted(k + 1 for k in config.layer_ids),
            "shard": f"{config.shard[0]}/{config.shard[1]}",
        }


def write_index(output: Path, samples: list[Sample], limit: int, sync: bool) -> None:
    """The dataset (``input_ids``, ``loss_mask``, ``seq_len``, torch format) of ``samples`` by row."""
    import datasets

    sequence = getattr(datasets, "List", None) or datasets.Sequence  # List from datasets 4 on
    ids = [s.input_ids[:limit] for s in samples]
    masks = [s.loss_mask[:limit] if s.loss_mask is not None else [1] * len(s.input_ids[:limit]) for s in samples]
    int64 = datasets.Value("int64")
    features = datasets.Features({"input_ids": sequence(int64), "loss_mask": sequence(int64), "seq_len": int64})
    dataset = datasets.Dataset.from_dict(
        {"input_ids": ids, "loss_mask": masks, "seq_len": [len(i) for i in ids]}, features=features
    )
    dataset.set_format(type="torch")  # what speculators' preprocessing saves: rows come back as tensors
    staging = output / INDEX_TMP
    shutil.rmtree(staging, ignore_errors=True)
    try:
        dataset.save_to_disk(str(staging))
        state = json.loads((staging / "state.json").read_text())
        keep = {entry["filename"] for entry in state.get("_data_files", [])}
        for stale in output.glob("data-*.arrow"):  # an earlier run's shards that this one does not list
            if stale.name not in keep:
                stale.unlink()
        for path in sorted(staging.iterdir(), key=lambda p: p.name == "state.json"):  # state.json last
            if sync:
                with path.open("rb") as handle:
                    os.fsync(handle.fileno())
            os.replace(path, output / path.name)
        if sync:
            fsync_directory(output)
    except OSError as exc:
        raise ExtractError(f"--output {output}: cannot write the dataset: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
