"""Adapter ``batch-order-log``: batch order log (speculators 0.3.0 slices by input offsets)."""

from __future__ import annotations

import functools
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from .. import speculators_code
from ..probe import Probe
from ..speculators_code import extension_method, worker_module
from ..unit import SPECULATORS_0_3_ONLY, Adapter


def probe_batch_order_log(ctx: Context) -> Probe:
    store = worker_module(ctx).HiddenStatesWorkerExtension._store_captured_states
    if "input_batch" in speculators_code.attribute_names_used(store):
        return Probe(False, "speculators orders captures by the runner's batch itself")
    return Probe(True, "speculators assumes the runner batched requests in input order; record it to verify")


def apply_batch_order_log(ctx: Context, patcher: AdapterPatcher) -> None:
    extension_cls, original = extension_method(ctx, "_store_captured_states")

    @functools.wraps(original)
    def _store_captured_states(self: Any, aux_hidden_states: Any) -> Any:
        batch = getattr(self.model_runner, "input_batch", None)
        if batch is None:
            raise NotImplementedError(
                f"{type(self.model_runner).__name__} has no input_batch (Model Runner V2?): the batch "
                "order speculators 0.3.0 slices by cannot be verified; set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        log = self.__dict__.setdefault("_spec_compat_batch_log", [])
        log.append([r for r in list(batch.req_ids)[: batch.num_reqs] if r is not None])
        return original(self, aux_hidden_states)

    def _spec_compat_take_batch_log(self: Any) -> list[list[str]]:
        log = self.__dict__.pop("_spec_compat_batch_log", [])
        return list(log)

    patcher.replace(extension_cls, "_store_captured_states", _store_captured_states)
    patcher.add(extension_cls, "_spec_compat_take_batch_log", _spec_compat_take_batch_log)


BATCH_ORDER_LOG = Adapter(
    id="batch-order-log",
    patches=(
        "speculators.data_generation.custom_worker.HiddenStatesWorkerExtension._store_captured_states",
        "speculators.data_generation.custom_worker.HiddenStatesWorkerExtension._spec_compat_take_batch_log",
    ),
    how="_spec_compat_take_batch_log added",
    why="0.3.0 slices captures by input offsets assuming the runner batched requests in input order",
    vllm_change="none: a latent speculators 0.3.0 assumption, verified instead of trusted",
    detect="AST: _store_captured_states does not read model_runner.input_batch",
    delete_when="speculators 0.3.0 is no longer supported",
    side="worker",
    probe=probe_batch_order_log,
    apply=apply_batch_order_log,
    speculators=SPECULATORS_0_3_ONLY,
)
