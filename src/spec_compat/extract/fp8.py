"""``--save-dtype fp8``: float8_e4m3fn states with one float32 scale per token, and their error.

The scheme is the one speculators' FP8 hidden-states connector writes and its reader undoes
(hs-connectors 0.9.0, ``hs_connectors/fp8_utils.py:15,29-60``: ``quantize_tensor_to_fp8`` and
``dequantize_fp8_tensor``; ``fp8_hidden_states_connector.py`` applies it to the
[seq_len, num_layers, hidden] tensor it saves): per token, the largest magnitude over every layer
and hidden unit, divided by float8_e4m3fn's largest finite value (448), is the scale (at least
1e-12, so an all-zero token divides by something); the states divided by it are cast to float8;
restored = float8 value x scale, in bf16 (its reader's default).

Computed here per layer ([seq_len, hidden] each, as the generator returns them) with the scale
taken over all layers, which gives the connector's values bit for bit without stacking the bf16
states into one more copy. The error is measured on the run's own states against the bf16 states
quantized (what a bf16 run writes): per layer, ``max_rel`` = the largest |restored - bf16| of a
token over that token's scale amplitude (its largest |value| over all layers), and ``mean_rel`` =
sum |restored - bf16| / sum |bf16| (the relative L1 error), both over every ``ERROR_TOKEN_STRIDE``-th
token of every sample (the quantization itself covers every token). All whole-tensor torch operations, no
per-token Python.
"""

from __future__ import annotations

from typing import Any

SCALES = "hidden_states_scales"  # the key speculators' FP8 reader looks for (hs_connectors.fp8_utils.SCALES_KEY)
MIN_SCALE = 1e-12
# The error is measured on every 8th token of every sample (tokens 0, 8, 16, ...): on all of them it
# cost 9x the quantization itself (fp8 -> bf16 and five more whole-tensor passes per layer), which
# made an fp8 extract on the H200 half as fast as bf16 (33.8k against 69.0k tokens/s, run N).
ERROR_TOKEN_STRIDE = 8


def quantize_layers(layers: list[Any]) -> tuple[list[Any], Any, dict[str, list[float]]]:
    """(float8 layers [seq_len, hidden] each, float32 scales [seq_len, 1], the error per layer)."""
    import torch

    fp8 = torch.float8_e4m3fn
    # The largest magnitude is taken in the states' own dtype (exact: |x| and max round nothing, and a
    # bf16 value widens to float32 exactly), so no float32 copy of a whole layer is made for it; each
    # layer is widened once, divided in place and cast (the writer threads' CPU was what bounded an
    # fp8 extract on the H200: 60.6 CPU-s of quantizing against 8.8 s of saving bf16, run Q).
    amax = torch.stack([h.abs().amax(dim=-1) for h in layers]).amax(dim=0).float()  # [seq_len]
    scale = (amax / torch.finfo(fp8).max).clamp(min=MIN_SCALE).unsqueeze(-1)  # [seq_len, 1]
    quantized = [h.to(torch.float32, copy=True).div_(scale).to(fp8) for h in layers]  # never the caller's
    error: dict[str, list[float]] = {"max_rel": [], "abs_err": [], "abs_ref": []}
    bf16 = torch.bfloat16
    rows = slice(None, None, ERROR_TOKEN_STRIDE)
    for layer, q in zip(layers, quantized, strict=True):
        restored = (q[rows].to(bf16) * scale[rows].to(bf16)).float()  # as the reader restores them
        reference_bf16 = layer[rows].to(bf16).float()
        diff = (restored - reference_bf16).abs()
        per_token = diff.amax(dim=-1) / amax[rows].clamp(min=MIN_SCALE)
        error["max_rel"].append(float(per_token.max()) if per_token.numel() else 0.0)
        error["abs_err"].append(float(diff.sum()))
        error["abs_ref"].append(float(reference_bf16.abs().sum()))
    return quantized, scale, error


def dequantize_layers(layers: list[Any], scale: Any, dtype: Any = None) -> list[Any]:
    """The states of an fp8 ``data_{i}.pt`` back in ``dtype`` (bf16 by default), as training reads them."""
    import torch

    dtype = dtype or torch.bfloat16
    return [h.to(dtype) * scale.to(dtype) for h in layers]


def load_v1(path: Any, dtype: Any = None) -> dict[str, Any]:
    """A ``data_{i}.pt`` of either dtype, its states restored: what speculators 0.3 / 0.4's dataset
    needs (it casts every state with ``.to(dtype)``, which would drop an fp8 file's scales)."""
    import torch

    sample = torch.load(path, weights_only=True)
    if SCALES in sample:
        sample["hidden_states"] = dequantize_layers(sample["hidden_states"], sample.pop(SCALES), dtype)
    return dict(sample)


def summarize(entries: list[dict[str, list[float]]]) -> dict[str, Any]:
    """The run's error per layer over every sample's: max of ``max_rel``, pooled ``mean_rel``."""
    if not entries:
        return {}
    layers = len(entries[0]["max_rel"])
    abs_err = [sum(e["abs_err"][k] for e in entries) for k in range(layers)]
    abs_ref = [sum(e["abs_ref"][k] for e in entries) for k in range(layers)]
    return {
        "samples": len(entries),
        "max_rel": [max(e["max_rel"][k] for e in entries) for k in range(layers)],
        "mean_rel": [err / ref if ref > 0 else 0.0 for err, ref in zip(abs_err, abs_ref, strict=True)],
        "reference": "bfloat16",
        "definition": "per layer: max_rel = max over tokens of max|restored - bf16| / the token's largest |bf16| "
        "over all layers (its scale x 448); mean_rel = sum|restored - bf16| / sum|bf16|",
        "tokens": f"every {ERROR_TOKEN_STRIDE}th token of every sample (0, {ERROR_TOKEN_STRIDE}, ...)",
    }
