"""Adapter ``results-contract``: what generate() returns checked against the output contract."""

from __future__ import annotations

from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..contract import check_results
from ..probe import Probe
from ..support import Run, as_run, wrap_generate
from ..unit import Adapter


def _hidden_size(generator: Any) -> int | None:
    model_config = generator.vllm_config.model_config
    getter = getattr(model_config, "get_hidden_size", None)
    try:
        return int(getter()) if getter is not None else int(model_config.hf_text_config.hidden_size)
    except Exception:  # noqa: BLE001
        return None


def probe_results_contract(ctx: Context) -> Probe:
    if not ctx.options.check_results:
        return Probe(False, "disabled by apply(check_results=False)")
    return Probe(True, "every generate() result is checked: count, order, input_ids, layers, shapes, finite")


def _finite_counts(generator: Any) -> tuple[int, int] | None:
    """(replies checked finite on the worker, replies not) so far, from spec_compat's executor."""
    counts = getattr(getattr(generator, "executor", None), "states_replies", None)
    return (counts["verified"], counts["unverified"]) if isinstance(counts, dict) else None


def apply_results_contract(ctx: Context, patcher: AdapterPatcher) -> None:
    def checked(generator: Any, token_ids: list[list[int]], run: Run) -> Any:
        before = _finite_counts(generator)
        results = run(token_ids)
        after = _finite_counts(generator)
        # The worker checked every value of every reply of this call where it was (on the
        # device, before the copy): the driver keeps only the cheap checks. Otherwise (no
        # shared-memory transfer, or a NaN/Inf found there) the full check runs here and names
        # the request and the layer.
        worker_checked = before is not None and after is not None and after[0] > before[0] and after[1] == before[1]
        check_results(
            results,
            as_run(generator, token_ids),
            list(generator.layer_ids),
            _hidden_size(generator),
            check_finite=not worker_checked,
        )
        return results

    wrap_generate(ctx, patcher, checked)


RESULTS_CONTRACT = Adapter(
    id="results-contract",
    patches=("speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.generate",),
    how="output contract check",
    why="wrong shapes or orders must never pass silently (771 x [512] instead of 4 x [771, 7168])",
    vllm_change="none: a guard",
    detect="apply(check_results=True), the default",
    delete_when="never",
    side="driver",
    probe=probe_results_contract,
    apply=apply_results_contract,
    # checks what the caller gets: the whole batch, in input order, layers in the requested order
    after=("single-step-batches", "sequence-limit", "input-order", "layer-ids"),
)
