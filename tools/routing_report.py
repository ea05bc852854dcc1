"""Per-token outlier report for tools/gpu_cells.py: is each token where vLLM and HF differ beyond
the strict per-token limit an expert flip, or something else?

For each outlier token (prompt p, token t, last over the limit at layer L) and each layer l <= L,
HF's own decoder layer l is run twice, with everything after it skipped:

* on HF's own residual stream: the experts HF selects (``hf_experts``) and its router margin;
* on vLLM's residual stream (vLLM's captured output of layer l - 1 fed as layer l's input, through
  a forward pre-hook): the experts HF's router picks for vLLM's input (``experts_on_vllm_input``)
  and the layer's output, compared with vLLM's own output of layer l (``replay_rel_l2``).

A replay within the limit means HF and vLLM compute the same layer l from the same input. Where
the replay is over the limit at a MoE layer, every expert set one swap away from HF's choice is
forced into HF's router output (a forward hook; the weights recomputed by the router's own rule,
checked against its unforced weights) and the set that reproduces vLLM's output best is reported
(``best_forced_experts``, ``best_forced_rel_l2``). Each token gets a ``kind``:
``expert_flip`` (every layer up to its last over-limit one replays within the limit or is
reproduced within the limit by a different expert set, and its own set differs at one of them;
the router margin there, lowest selected score minus highest unselected one in the router's
selection scores, says how near the tie was), ``flip_through_attention`` (no flip of its own, an
earlier token of the prompt flips), ``accumulated_rounding`` (every layer replays within the limit
and nothing flips: the sum of in-limit per-layer differences), ``layer_mismatch`` (a layer differs
on vLLM's own input and no expert set reproduces it: a real difference). Only the first two count
as ``explained``.

Needs transformers 5's MoE router interface (``mlp.gate`` returning (logits, weights, indices)
beside ``mlp.experts``); another interface is reported as such, never guessed.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

OUTLIER_TOKEN_CAP = 128  # the worst tokens analysed per cell (the count of all is reported)
DETAIL_ROWS = 24  # the worst tokens keep their per-layer evidence in the record; the rest their verdict
MAX_CANDIDATE_SETS = 70  # try every expert set up to C(8, 4); one HF forward per set and layer


class _StopForward(Exception):
    """Raised by the hook after the layer of interest: the rest of the model is not needed."""


@dataclass
class LayerRun:
    output: torch.Tensor  # [tokens, hidden] float32, the layer's output (residual stream)
    logits: torch.Tensor | None = None  # [tokens, experts] router logits
    indices: torch.Tensor | None = None  # [tokens, k] selected experts
    weights: torch.Tensor | None = None  # [tokens, k] their weights
    router_note: str | None = None


@dataclass
class Limits:
    max_rel_l2: float
    min_cosine: float | None

    def over(self, rel: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        bad = rel > self.max_rel_l2
        return bad | (cos < self.min_cosine) if self.min_cosine is not None else bad


@dataclass
class Analysis:
    model: Any
    layers: torch.nn.ModuleList
    device: str
    limits: Limits
    weight_rule_error: float = 0.0
    notes: list[str] = field(default_factory=list)


def moe_parts(layer: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """(router, experts) of a transformers-5 MoE decoder layer, (None, None) for a dense one."""
    mlp = getattr(layer, "mlp", None)
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    return (gate, experts) if gate is not None and experts is not None else (None, None)


def selection_scores(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The scores the router ranks experts by: sigmoid + correction bias (DeepSeek-V3's noaux_tc,
    a router with ``e_score_correction_bias``) or softmax probabilities (Qwen3-MoE, Mixtral)."""
    bias = getattr(router, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        return logits.sigmoid() + bias.detach().float().cpu()
    return logits.softmax(dim=-1)


def expert_weights(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The router's own weight rule for a chosen set (``experts`` [k]) of one token's ``logits`` [E]."""
    if hasattr(router, "e_score_correction_bias"):
        chosen = logits.sigmoid()[experts]
        if getattr(router, "norm_topk_prob", False):
            chosen = chosen / (chosen.sum() + 1e-20)
        return chosen * float(getattr(router, "routed_scaling_factor", 1.0))
    chosen = logits.softmax(dim=-1)[experts]
    if getattr(router, "norm_topk_prob", False):
        chosen = chosen / chosen.sum()
    return chosen


def router_margin(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> float | None:
    """How near the choice was to a tie: lowest selected score minus highest unselected one among
    the experts the router could pick. A group-limited router (DeepSeek-V3: ``num_group`` groups,
    the best ``topk_group`` by their top-2 sum, experts only from those) also has a group margin
    (lowest chosen group score minus highest unchosen); the smaller of the two is returned. None
    when every eligible expert is selected."""
    scores = selection_scores(router, logits)
    selected = torch.zeros_like(scores, dtype=torch.bool)
    selected[experts] = True
    eligible = torch.ones_like(selected)
    margins = []
    groups, topk_groups = int(getattr(router, "num_group", 1) or 1), int(getattr(router, "topk_group", 1) or 1)
    if groups > 1 and topk_groups < groups:
        per_group = scores.view(groups, -1)
        group_scores = per_group.topk(min(2, per_group.shape[1]), dim=-1).values.sum(dim=-1)
        chosen_groups = selected.view(groups, -1).any(dim=-1)
        margins.append(float(group_scores[chosen_groups].min() - group_scores[~chosen_groups].max()))
        eligible = chosen_groups.unsqueeze(-1).expand_as(per_group).reshape(-1)
    unselected = eligible & ~selected
    if bool(unselected.any()):
        margins.append(float(scores[selected].min() - scores[unselected].max()))
    return min(margins) if margins else None


def one_swap_sets(experts: list[int], num_experts: int) -> list[list[int]]:
    """Every set that differs from ``experts`` in exactly one member."""
    others = [e for e in range(num_experts) if e not in experts]
    return [sorted([*experts[:i], *experts[i + 1 :], u]) for i in range(len(experts)) for u in others]


def candidate_sets(experts: list[int], num_experts: int) -> list[list[int]]:
    """The other expert sets to try: all of them while there are at most MAX_CANDIDATE_SETS (a
    group-limited router's group flip changes every member), else the one-swap sets."""
    if math.comb(num_experts, len(experts)) <= MAX_CANDIDATE_SETS:
        every = [sorted(c) for c in itertools.combinations(range(num_experts), len(experts))]
        return [c for c in every if c != sorted(experts)]
    return one_swap_sets(experts, num_experts)


def run_layer(
    analysis: Analysis,
    ids: list[int],
    layer: int,
    stream_in: torch.Tensor | None = None,
    forced: dict[int, list[int]] | None = None,
) -> LayerRun:
    """HF's decoder layer ``layer`` on the prompt, its input replaced by ``stream_in`` when given,
    the router's choice for token t replaced by ``forced[t]`` when given."""
    target = analysis.layers[layer]
    router, _ = moe_parts(target)
    got: dict[str, Any] = {}
    handles: list[Any] = []

    def replace_input(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        new = stream_in.to(device=hidden.device, dtype=hidden.dtype).reshape(hidden.shape)  # type: ignore[union-attr]
        if args:
            return (new, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": new}

    def keep_output(module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        got["output"] = hidden.detach()[0].float().cpu()
        raise _StopForward

    def router_hook(module: Any, args: Any, output: Any) -> Any:
        if not (isinstance(output, tuple) and len(output) == 3):
            got["router_note"] = f"router returns {type(output).__name__}, not (logits, weights, indices)"
            return None
        logits, weights, indices = output
        got["logits"] = logits.detach().float().cpu()
        if forced:
            indices, weights = indices.clone(), weights.clone()
            for token, experts in forced.items():
                chosen = torch.tensor(experts, dtype=indices.dtype)
                indices[token] = chosen.to(indices.device)
                new_weights = expert_weights(module, got["logits"][token], chosen.long())
                weights[token] = new_weights.to(device=weights.device, dtype=weights.dtype)
        got["indices"] = indices.detach().cpu()
        got["weights"] = weights.detach().float().cpu()
        return (logits, weights, indices) if forced else None

    if stream_in is not None:
        handles.append(target.register_forward_pre_hook(replace_input, with_kwargs=True))
    handles.append(target.register_forward_hook(keep_output))
    if router is not None:
        handles.append(router.register_forward_hook(router_hook))
    try:
        with torch.inference_mode():
            analysis.model(input_ids=torch.tensor([ids], dtype=torch.long, device=analysis.device), use_cache=False)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return LayerRun(got["output"], got.get("logits"), got.get("indices"), got.get("weights"), got.get("router_note"))


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    g, w = got.double(), want.double()
    error: torch.Tensor = (g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-30)
    return error


def cosine(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    similarity: torch.Tensor = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    return similarity


def find_outliers(
    got: list[list[torch.Tensor]], want: list[list[torch.Tensor]], layer_ids: list[int], limits: Limits
) -> list[dict[str, Any]]:
    """Every (prompt, token) over the limit at some captured layer, worst first."""
    rows = []
    for p, (got_layers, want_layers) in enumerate(zip(got, want, strict=True)):
        order = sorted(range(len(layer_ids)), key=lambda k: layer_ids[k])
        rel = torch.stack([rel_l2(got_layers[k], want_layers[k]) for k in order])  # [layers, tokens]
        cos = torch.stack([cosine(got_layers[k], want_layers[k]) for k in order])
        over = limits.over(rel, cos)
        for t in torch.nonzero(over.any(dim=0)).flatten().tolist():
            over_layers = torch.nonzero(over[:, t]).flatten().tolist()
            rows.append(
                {
                    "prompt": p,
                    "token": t,
                    "first_over_limit_layer": layer_ids[order[over_layers[0]]],
                    "last_over_limit_layer": layer_ids[order[over_layers[-1]]],
                    "rel_l2_max": float(rel[:, t].max()),
                    "cosine_min": float(cos[:, t].min()),
                }
            )
    return sorted(rows, key=lambda r: -r["rel_l2_max"])


def analyse_prompt(
    analysis: Analysis,
    ids: list[int],
    vllm_out: dict[int, torch.Tensor],
    tokens: list[dict[str, Any]],
) -> dict[int, list[int]]:
    """Fill each token row of one prompt with its per-layer routing evidence (in place). Returns,
    per MoE layer, every token of the prompt (analysed or not) that flips there: its expert set on
    vLLM's input differs from HF's own, or its replay is over the limit and another expert set
    reproduces vLLM's output. A flip reaches later tokens through attention."""
    limit = analysis.limits
    last = max(r["last_over_limit_layer"] for r in tokens)
    flips: dict[int, list[int]] = {}
    for row in tokens:
        row["layers"] = []
    for layer in range(last + 1):
        if (layer > 0 and layer - 1 not in vllm_out) or layer not in vllm_out:
            for row in tokens:
                if row["last_over_limit_layer"] >= layer:
                    row["layers"].append({"layer": layer, "note": "vLLM's input or output of this layer not captured"})
            continue
        router, _ = moe_parts(analysis.layers[layer])
        own = run_layer(analysis, ids, layer)
        stream_in = vllm_out[layer - 1] if layer > 0 else None  # layer 0's input: the same embeddings
        on_vllm = run_layer(analysis, ids, layer, stream_in)
        replay = rel_l2(on_vllm.output, vllm_out[layer])
        replay_cos = cosine(on_vllm.output, vllm_out[layer])
        active = [r for r in tokens if r["last_over_limit_layer"] >= layer]
        # Every token of the prompt whose replay is over the limit, not only the analysed ones: the
        # forced sets of all of them go into the same forward (routing is per token).
        need_forcing = torch.nonzero(limit.over(replay, replay_cos)).flatten().tolist() if router is not None else []
        best: dict[int, tuple[float, list[int]]] = {}
        if need_forcing and on_vllm.indices is not None and on_vllm.logits is not None:
            num_experts = on_vllm.logits.shape[-1]
            candidates = {t: candidate_sets(sorted(on_vllm.indices[t].tolist()), num_experts) for t in need_forcing}
            candidates = {t: sets for t, sets in candidates.items() if sets}
            for c in range(max((len(v) for v in candidates.values()), default=0)):
                forced = {t: sets[c] for t, sets in candidates.items() if c < len(sets)}
                if not forced:
                    continue
                run = run_layer(analysis, ids, layer, stream_in, forced)
                for t, experts in forced.items():
                    err = float(rel_l2(run.output[t], vllm_out[layer][t]))
                    if t not in best or err < best[t][0]:
                        best[t] = (err, experts)
        if own.indices is not None and on_vllm.indices is not None:
            differs = (own.indices.sort(dim=-1).values != on_vllm.indices.sort(dim=-1).values).any(dim=-1)
            flipped = set(torch.nonzero(differs).flatten().tolist())
            flipped |= {t for t, (err, _) in best.items() if err <= limit.max_rel_l2}
            flips[layer] = sorted(flipped)
        if router is not None and own.indices is not None and own.logits is not None and own.weights is not None:
            rule = max(
                float((expert_weights(router, own.logits[t], own.indices[t].long()) - own.weights[t]).abs().max())
                for t in range(own.indices.shape[0])
            )
            analysis.weight_rule_error = max(analysis.weight_rule_error, rule)
        for row in active:
            t = row["token"]
            entry: dict[str, Any] = {
                "layer": layer,
                "moe": router is not None,
                "replay_rel_l2": float(replay[t]),
                "replay_cosine": float(replay_cos[t]),
            }
            if own.router_note or on_vllm.router_note:
                entry["note"] = own.router_note or on_vllm.router_note
            if router is not None and own.indices is not None and on_vllm.indices is not None:
                assert own.logits is not None and on_vllm.logits is not None
                entry["hf_experts"] = sorted(own.indices[t].tolist())
                entry["experts_on_vllm_input"] = sorted(on_vllm.indices[t].tolist())
                entry["margin_hf"] = router_margin(router, own.logits[t], own.indices[t].long())
                entry["margin_on_vllm_input"] = router_margin(router, on_vllm.logits[t], on_vllm.indices[t].long())
            if t in best:
                entry["best_forced_rel_l2"], entry["best_forced_experts"] = best[t]
            row["layers"].append(entry)
    return flips


# What made a token differ (``kind``); the first two are expert flips (``explained``).
EXPERT_FLIP = "expert_flip"  # its own expert set differs at some layer
FLIP_THROUGH_ATTENTION = "flip_through_attention"  # an earlier token of its prompt flipped
ACCUMULATED = "accumulated_rounding"  # every layer replays within the limit, no flip: the sum of in-limit errors
LAYER_MISMATCH = "layer_mismatch"  # a layer differs on vLLM's own input and no expert set reproduces it
NOT_OBSERVABLE = "not_observable"  # a layer's vLLM input or output was not captured


def verdict_for_token(row: dict[str, Any], limits: Limits) -> None:
    """``kind`` / ``explained`` / ``first_flip_layer`` / ``why`` from the token's own evidence at
    every layer up to its last over-limit one (in place); a token with no flip and no mismatch of
    its own is settled by ``inherited_flip`` afterwards."""
    flip_layer = None
    flip_margin = None
    for entry in row["layers"]:
        if "replay_rel_l2" not in entry:
            row.update(kind=NOT_OBSERVABLE, explained=False, why=f"layer {entry['layer']}: {entry.get('note')}")
            return
        replay_ok = not bool(limits.over(torch.tensor(entry["replay_rel_l2"]), torch.tensor(entry["replay_cosine"])))
        stream_flip = entry.get("hf_experts") != entry.get("experts_on_vllm_input")
        forced_ok = (
            "best_forced_rel_l2" in entry
            and entry["best_forced_rel_l2"] <= limits.max_rel_l2
            and entry["best_forced_experts"] != entry.get("experts_on_vllm_input")
        )
        if not replay_ok and not forced_ok:
            why = (
                f"layer {entry['layer']}: HF on vLLM's input differs from vLLM's output "
                f"(rel-L2 {entry['replay_rel_l2']:.2e})"
            )
            if "best_forced_rel_l2" in entry:
                why += f" and no other expert set reproduces it (best {entry['best_forced_rel_l2']:.2e})"
            row.update(kind=LAYER_MISMATCH, explained=False, why=why)
            return
        if forced_ok:
            entry["vllm_experts"] = entry["best_forced_experts"]  # what reproduces vLLM's output
        if flip_layer is None and (stream_flip or forced_ok):
            flip_layer = entry["layer"]
            flip_margin = entry.get("margin_hf") if stream_flip else entry.get("margin_on_vllm_input")
    if flip_layer is None:
        why = "every layer replays within the limit; no expert set of its own differs"
        row.update(kind=None, explained=None, why=why)
        return
    row.update(
        kind=EXPERT_FLIP,
        explained=True,
        first_flip_layer=flip_layer,
        flip_margin=flip_margin,
        why=f"own expert set differs first at layer {flip_layer} (router margin {flip_margin})",
    )


def inherited_flip(row: dict[str, Any], flips: dict[int, set[int]]) -> None:
    """A token that replays within the limit everywhere without a flip of its own is explained when
    an earlier (or the same) token of its prompt flipped at a layer up to its last over-limit one:
    attention carries that difference into it. Otherwise its difference is the accumulation of
    per-layer differences each within the limit (no layer of vLLM disagrees with HF's)."""
    last = row["last_over_limit_layer"]
    for layer in sorted(flips):
        sources = sorted(t for t in flips[layer] if t <= row["token"])
        if layer <= last and sources:
            row.update(
                kind=FLIP_THROUGH_ATTENTION,
                explained=True,
                first_flip_layer=layer,
                flip_margin=None,
                inherited_from_tokens=sources[:8],
                why=f"no flip of its own; token(s) {sources[:8]} of the prompt flip at layer {layer}",
            )
            return
    row.update(kind=ACCUMULATED, explained=False, why=row["why"] + ", and no earlier token of the prompt flips")


def outlier_report(
    load_model: Callable[[Path], Any],
    layers_of: Callable[[Any], torch.nn.ModuleList],
    model_dir: Path,
    prompts: list[list[int]],
    layer_ids: list[int],
    got: list[list[torch.Tensor]],
    want: list[list[torch.Tensor]],
    limits: Limits,
    device: str,
    cap: int = OUTLIER_TOKEN_CAP,
    max_seconds: float = float("inf"),
) -> dict[str, Any]:
    """The report for one cell: counts, and the evidence of the worst ``cap`` tokens (their prompts
    in order of their worst token, none started after ``max_seconds``)."""
    outliers = find_outliers(got, want, layer_ids, limits)
    report: dict[str, Any] = {"outlier_tokens": len(outliers), "tokens": sum(len(ids) for ids in prompts)}
    if not outliers:
        return report
    chosen = outliers[:cap]
    model = load_model(model_dir).to(device)
    analysis = Analysis(model, layers_of(model), device, limits)
    flips_by_prompt: dict[int, dict[int, set[int]]] = {}
    began = time.perf_counter()
    try:
        for p in dict.fromkeys(r["prompt"] for r in chosen):  # the prompt of the worst token first
            if time.perf_counter() - began > max_seconds:
                report["stopped"] = f"time limit ({max_seconds:.0f} s): later prompts not analysed"
                break
            vllm_out = {layer_ids[k]: got[p][k] for k in range(len(layer_ids))}
            flips = analyse_prompt(analysis, prompts[p], vllm_out, [r for r in chosen if r["prompt"] == p])
            flips_by_prompt[p] = {layer: set(tokens) for layer, tokens in flips.items()}
    finally:
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    chosen = [r for r in chosen if r["prompt"] in flips_by_prompt]
    for row in chosen:
        verdict_for_token(row, limits)
        if row["explained"] and row.get("first_flip_layer") is not None:
            flips_by_prompt[row["prompt"]].setdefault(row["first_flip_layer"], set()).add(row["token"])
    for row in chosen:
        if row["explained"] is None:
            inherited_flip(row, flips_by_prompt[row["prompt"]])
    for row in chosen[DETAIL_ROWS:]:
        row.pop("layers", None)  # keeps a cell record small; kind, why and margin stay
    explained = [r for r in chosen if r["explained"]]
    margins = [abs(r["flip_margin"]) for r in explained if r.get("flip_margin") is not None]
    report.update(
        analysed=len(chosen),
        explained_by_expert_flip=len(explained),
        unexplained=len(chosen) - len(explained),
        kinds=dict(Counter(str(r["kind"]) for r in chosen)),
        first_flip_layers=dict(Counter(str(r["first_flip_layer"]) for r in explained)),
        flip_margin_median=statistics.median(margins) if margins else None,
        flip_margin_max=max(margins) if margins else None,
        weight_rule_error=analysis.weight_rule_error,
        limits={"max_rel_l2": limits.max_rel_l2, "min_cosine": limits.min_cosine},
        per_token=chosen,
    )
    return report
