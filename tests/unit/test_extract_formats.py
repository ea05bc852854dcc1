"""extract's formats and fp8 without an engine: files, names, the dataset index, the error figures.

speculators 0.9.0's own reader on real extract output is tests/test_extract.py's (engine) test; here
the fp8 scheme is checked bit for bit against hs-connectors' own functions where its install exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from spec_compat import cli
from spec_compat.extract import BackgroundWriter, ExtractConfig, ExtractError, Manifest, ModelFacts, Sample, formats
from spec_compat.extract.formats.hs import SpeculatorsHs
from spec_compat.extract.formats.v1 import SpeculatorsV1
from spec_compat.extract.fp8 import (
    ERROR_TOKEN_STRIDE,
    SCALES,
    dequantize_layers,
    load_v1,
    quantize_layers,
    summarize,
)

READER_ENV = "SPEC_COMPAT_SPECULATORS_READER"  # the speculators 0.9.0 reader install (tools/provision.sh)


def _states(tokens: int, layers: int = 3, hidden: int = 16, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # magnitudes that differ per token and per layer, and one all-zero token (the scale's floor)
    states = [torch.randn(tokens, hidden, generator=generator) * (1 + 10 * k) for k in range(layers)]
    for h in states:
        h[0] = 0.0
    return [h.to(torch.bfloat16) for h in states]


def _payload(tokens: int, seed: int = 0) -> dict[str, Any]:
    return {
        "input_ids": torch.arange(tokens, dtype=torch.long),
        "hidden_states": _states(tokens, seed=seed),
        "loss_mask": torch.ones(tokens, dtype=torch.long),
    }


def _config(tmp_path: Path, **kwargs: Any) -> ExtractConfig:
    return ExtractConfig(model="m", input=tmp_path / "in.jsonl", output=tmp_path / "out", layer_ids=[2, 0, 3], **kwargs)


def test_the_cli_offers_every_format() -> None:
    assert tuple(formats.FORMATS) == cli.EXTRACT_FORMATS


def test_fp8_restores_within_its_recorded_error_and_the_figures_are_not_zero() -> None:
    layers = _states(40)
    quantized, scale, error = quantize_layers(layers)
    assert all(q.dtype == torch.float8_e4m3fn for q in quantized) and scale.shape == (40, 1)
    restored = dequantize_layers(quantized, scale)
    amax = torch.stack([h.float().abs().amax(dim=-1) for h in layers]).amax(dim=0).clamp(min=1e-12)
    amax = amax[::ERROR_TOKEN_STRIDE]  # the error is measured on every 8th token (0, 8, ...)
    for k, (h, r) in enumerate(zip(layers, restored, strict=True)):
        diff = (r.float() - h.float()).abs()[::ERROR_TOKEN_STRIDE]
        h = h[::ERROR_TOKEN_STRIDE]
        assert float((diff.amax(dim=-1) / amax).max()) == pytest.approx(error["max_rel"][k], rel=1e-6)
        assert float(diff.sum()) / float(h.float().abs().sum()) == pytest.approx(
            error["abs_err"][k] / error["abs_ref"][k], rel=1e-4
        )
    assert torch.equal(restored[0][0], torch.zeros(16, dtype=torch.bfloat16))  # a zero token stays zero
    summary = summarize([error, error])
    assert summary["samples"] == 2 and summary["max_rel"] == error["max_rel"]
    assert all(0 < x <= 1 / 16 for x in summary["max_rel"])  # e4m3: 3 mantissa bits, under half an ulp of 2^-3
    assert all(0 < x < 0.05 for x in summary["mean_rel"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_quantizing_leaves_the_callers_states_as_they_were(dtype: torch.dtype) -> None:
    """The quantizer divides a float32 copy in place: never the payload's own tensors (a float32
    layer's ``.float()`` would be the layer itself), and the result is the same from either dtype."""
    layers = [h.to(dtype) for h in _states(40)]
    before = [h.clone() for h in layers]
    quantized, scale, _ = quantize_layers(layers)
    assert all(torch.equal(h, b) for h, b in zip(layers, before, strict=True))
    expected, expected_scale, _ = quantize_layers(_states(40))
    assert torch.equal(scale, expected_scale)
    assert all(torch.equal(q.view(torch.uint8), e.view(torch.uint8)) for q, e in zip(quantized, expected, strict=True))


def test_fp8_is_hs_connectors_own_scheme_bit_for_bit() -> None:
    reader = os.environ.get(READER_ENV)
    source = Path(reader or "/nonexistent") / "hs_connectors" / "fp8_utils.py"
    if not source.exists():
        message = f"hs-connectors not provided ({READER_ENV}={reader!r})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    spec = importlib.util.spec_from_file_location("hs_fp8_utils", source)
    assert spec is not None and spec.loader is not None
    theirs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(theirs)  # imports torch only: no need for the rest of that environment
    layers = _states(33)
    ours, scale, _ = quantize_layers(layers)
    their_fp8, their_scale = theirs.quantize_tensor_to_fp8(torch.stack(layers, dim=1))
    assert torch.equal(torch.stack(ours, dim=1).view(torch.uint8), their_fp8.view(torch.uint8))
    assert torch.equal(scale.unsqueeze(-1), their_scale)
    restored = theirs.dequantize_fp8_tensor(their_fp8, their_scale)
    assert torch.equal(torch.stack(dequantize_layers(ours, scale), dim=1), restored)
    assert theirs.SCALES_KEY == SCALES


def test_v1_fp8_files_hold_fp8_states_and_scales_and_load_v1_restores_them(tmp_path: Path) -> None:
    manifest = Manifest(tmp_path, {"model": "m", "layer_ids": [1], "format": "f", "save_dtype": "fp8", "run": {}})
    writer = BackgroundWriter(tmp_path, manifest, threads=2, pending=1, fmt=SpeculatorsV1(fp8=True))
    writer.submit([(0, _payload(12)), (1, _payload(7, seed=1))])
    writer.close()
    raw = torch.load(tmp_path / "data_0.pt", weights_only=True)
    assert [h.dtype for h in raw["hidden_states"]] == [torch.float8_e4m3fn] * 3 and raw[SCALES].shape == (12, 1)
    restored = load_v1(tmp_path / "data_0.pt")
    assert SCALES not in restored and restored["hidden_states"][2].dtype == torch.bfloat16
    original = _payload(12)["hidden_states"][2].float()
    assert float((restored["hidden_states"][2].float() - original).abs().max()) <= original.abs().max() / 16
    saved = json.loads((tmp_path / "manifest.json").read_text())
    assert saved["fp8_error"]["samples"] == 2 and len(saved["fp8_error"]["max_rel"]) == 3
    assert len(saved["samples"]["1"]["fp8"]["max_rel"]) == 3


def test_v1_bf16_entries_and_manifest_keep_their_fields(tmp_path: Path) -> None:
    manifest = Manifest(tmp_path, {"model": "m", "layer_ids": [1], "format": "f", "run": {}})
    writer = BackgroundWriter(tmp_path, manifest, threads=1, pending=1)
    writer.submit([(0, _payload(5))])
    writer.close()
    saved = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(saved) == ["failed", "provenance", "runs", "samples"]
    assert sorted(saved["samples"]["0"]) == ["file", "num_tokens", "sha256"]


def test_hs_files_are_named_by_row_hold_layers_in_ascending_order_and_the_dataset_lists_every_row(
    tmp_path: Path,
) -> None:
    from safetensors import safe_open

    pytest.importorskip("datasets")
    import datasets

    config = _config(tmp_path, format="speculators-hs", max_model_len=9)
    fmt = formats.get(config)
    assert isinstance(fmt, SpeculatorsHs) and fmt.order == [1, 0, 2]
    samples = [Sample(0, [5] * 4), Sample(2, [6] * 12, [0] * 6 + [1] * 6), Sample(5, [7] * 3, [1, 0, 1])]
    for row, sample in enumerate(samples):  # as checked_samples numbers them (lines 1, 3, 4 blank or bad)
        sample.row = row
    config.output.mkdir()
    fmt.prepare(config.output, samples, limit=8, sync=True)
    manifest = Manifest(config.output, {"model": "m", "layer_ids": [2, 0, 3], "format": fmt.manifest_format,
                                        "run": {}})  # fmt: skip
    writer = BackgroundWriter(config.output, manifest, threads=2, pending=1, fmt=fmt)
    payload = _payload(8)
    writer.submit([(2, payload)], [fmt.file_name(2, 1)])
    writer.close()
    assert manifest.data["samples"]["2"]["file"] == "hidden_states/hs_1.safetensors"
    with safe_open(str(config.output / "hidden_states" / "hs_1.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == ["hidden_states", "token_ids"]
        stacked = handle.get_tensor("hidden_states")
        assert stacked.shape == (8, 3, 16) and handle.get_tensor("token_ids").dtype == torch.long
    expected = [payload["hidden_states"][k] for k in (1, 0, 2)]  # layers 0, 2, 3
    assert all(torch.equal(stacked[:, k], expected[k]) for k in range(3))
    index = datasets.load_from_disk(str(config.output))
    assert index.format["type"] == "torch" and len(index) == 3
    assert index[1]["input_ids"].tolist() == [6] * 8 and index[1]["loss_mask"].tolist() == [0] * 6 + [1] * 2
    assert index[2]["loss_mask"].tolist() == [1, 0, 1] and list(index.with_format(None)["seq_len"]) == [4, 8, 3]
    fmt.prepare(config.output, samples[:2], limit=8, sync=False)  # a rerun rewrites it whole
    assert len(datasets.load_from_disk(str(config.output))) == 2
    assert not list(config.output.glob(".spec-compat-dataset.tmp"))


def test_hs_fp8_files_carry_the_connectors_scales(tmp_path: Path) -> None:
    from safetensors import safe_open

    fmt = SpeculatorsHs(fp8=True, layer_ids=[0, 1, 2])
    path = tmp_path / "hs_0.safetensors"
    extra = fmt.save(_payload(6), path)
    assert extra is not None and len(extra["fp8"]["max_rel"]) == 3
    with safe_open(str(path), framework="pt") as handle:
        assert sorted(handle.keys()) == ["hidden_states", "hidden_states_scales", "token_ids"]
        assert handle.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
        assert handle.get_tensor("hidden_states_scales").shape == (6, 1, 1)
    assert SpeculatorsHs(layer_ids=[0, 1, 2]).save(_payload(6), tmp_path / "bf16.safetensors") is None
    with safe_open(str(path), framework="pt") as handle:  # 1 byte a state, 4 a token's scale (bf16: 2 a state)
        assert handle.get_tensor("hidden_states").nbytes == 6 * 3 * 16
    assert path.stat().st_size < (tmp_path / "bf16.safetensors").stat().st_size


def test_hs_refuses_layer_ids_without_the_last_layer(tmp_path: Path) -> None:
    fmt = formats.get(_config(tmp_path, format="speculators-hs"))
    with pytest.raises(ExtractError, match=r"must include the model's last layer 5"):
        fmt.check(_config(tmp_path, format="speculators-hs"), ModelFacts(vocab_size=10, num_layers=6))
    fmt.check(_config(tmp_path, format="speculators-hs"), ModelFacts(vocab_size=10, num_layers=4))
    assert fmt.provenance(_config(tmp_path, shard=(1, 2))) == {
        "file_layer_ids": [0, 2, 3],
        "native_layer_ids": [1, 3, 4],
        "shard": "1/2",
    }


def test_a_rerun_with_another_format_or_save_dtype_is_refused(tmp_path: Path) -> None:
    base = {"model": "m", "layer_ids": [1], "format": "speculators-eagle3-v1", "save_dtype": "bfloat16", "run": {}}
    Manifest(tmp_path, base).save()
    for change in ({"format": "speculators-hs"}, {"save_dtype": "fp8"}, {"shard": "1/2"}):
        with pytest.raises(ValueError, match="use another --output"):
            Manifest(tmp_path, {**base, **change})
    Manifest(tmp_path, base)


def test_extract_modules_import_only_modules_listed_before_them() -> None:
    """The package docstring's order is a topological order of its imports: no import circle."""
    import ast
    import re

    import spec_compat.extract as package

    root = Path(package.__file__).parent
    order = re.findall(r"^- ``(\w+)``", package.__doc__ or "", flags=re.M)
    order += [m for line in (package.__doc__ or "").splitlines() if line.startswith("- ``replica``")
              for m in re.findall(r"``(\w+)``", line)][1:]  # fmt: skip
    modules = {p.stem: p for p in root.glob("*.py") if p.stem != "__init__"} | {"formats": root / "formats"}
    assert sorted(set(order)) == sorted(modules), (order, sorted(modules))
    for name, path in modules.items():
        files = sorted(path.glob("*.py")) if path.is_dir() else [path]
        imported: set[str] = set()
        for file in files:
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = (node.module or "").split(".")[0]
                    up = node.level - (1 if path.is_dir() else 0)  # formats/x.py: ".." is the package
                    if up == 1 and base:
                        imported.add(base)
                    elif up == 1:
                        imported.update(alias.name for alias in node.names)
        imported &= set(modules) - {name}
        later = [m for m in imported if order.index(m) > order.index(name)]
        assert not later, f"{name} imports {later}, listed after it"
