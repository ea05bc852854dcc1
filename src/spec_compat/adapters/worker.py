"""Worker-side adapters: patch ``speculators.data_generation.custom_worker`` inside each vLLM
worker process (through the ``vllm.general_plugins`` entry point) and in the driver (for fork)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import warnings
from collections.abc import Callable
from itertools import islice
from typing import Any

import wrapt

from ..options import Context
from ..patching import AdapterPatcher
from . import speculators_code, transfer
from .probe import Probe
from .remote_errors import EncodedWorkerException, encode
from .speculators_code import extension_method, worker_module
from .unit import SPECULATORS_0_3_ONLY, Adapter

logger = logging.getLogger("spec_compat.worker")


def tp_rank() -> int | None:
    try:
        from vllm.distributed import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - no process group (yet): rank unknown
        return None


def _base_model(model: Any) -> Any:
    return find_base_model(model)


# ---- loud worker errors -----------------------------------------------------------------------------------


def _loud(method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EncodedWorkerException:
            raise
        except Exception as exc:
            raise encode(exc, tp_rank(), method) from exc

    wrapper.spec_compat_loud = True  # type: ignore[attr-defined]
    return wrapper


def probe_loud_worker_errors(ctx: Context) -> Probe:
    return Probe(True, "vLLM sends only str(exc) from a worker: no type, rank or traceback ('' for AssertionError())")


def apply_loud_worker_errors(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    extension = worker.HiddenStatesWorkerExtension
    for name, value in list(vars(extension).items()):
        if inspect.isfunction(value) and not getattr(value, "spec_compat_loud", False):
            patcher.replace(extension, name, _loud(name, value))
    patcher.replace(
        worker,
        "_patched_forward",
        _loud("model forward (_patched_forward)", worker._patched_forward),
    )


LOUD_WORKER_ERRORS = Adapter(
    id="loud-worker-errors",
    notes="""
    why: a worker exception reaches the caller as `Worker failed with error ''`: no type, rank or traceback
    vllm change: all releases: WorkerProc replies (FAILURE, str(exc))
    detect: always
    delete when: vLLM transports exception type and traceback from workers
    patches: every HiddenStatesWorkerExtension method and custom_worker._patched_forward
    """,
    side="worker",
    probe=probe_loud_worker_errors,
    apply=apply_loud_worker_errors,
    # wraps the extension's methods and _patched_forward as the other worker adapters left them (it
    # skips what is already loud, so one applied after it would replace a loud method with a silent one)
    after=("wrapper-base-model", "capture-setup", "layer-kwargs", "batch-order-log", "captured-states-shared-memory"),
)


# ---- supports_eagle3 refusal (speculators 0.3.0) ---------------------------------------------------------
# 0.3.0 refuses any model that does not declare vLLM's SupportsEagle3 interface (Mixtral never
# does, Qwen3-MoE only from 0.11.2, DeepSeek-V2/V3 from 0.18.1) although its capture only needs a
# base model with `layers`: which is what 0.4.x checks instead.


def probe_capture_gate(ctx: Context) -> Probe:
    if "supports_eagle3" in vars(worker_module(ctx)):
        return Probe(True, "speculators gates capture on vLLM's SupportsEagle3 interface")
    return Probe(False, "speculators does not gate on SupportsEagle3")


def apply_capture_gate(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    original = worker.supports_eagle3

    @functools.wraps(original)
    def supports_capture(model: Any) -> bool:
        base = _base_model(model)
        return bool(original(model)) or (base is not None and hasattr(base, "layers"))

    patcher.replace(worker, "supports_eagle3", supports_capture)


CAPTURE_GATE = Adapter(
    id="capture-gate",
    notes="""
    why: 0.3.0 refuses models without vLLM's SupportsEagle3 interface although capture only needs `layers`
    vllm change: models gained SupportsEagle3 late (Qwen3-MoE 0.11.2, DeepSeek-V2/V3 0.18.1; Mixtral never)
    detect: custom_worker defines the name supports_eagle3
    delete when: speculators 0.3.0 is no longer supported (0.4.x checks for `layers` instead)
    patches: custom_worker.supports_eagle3
    """,
    side="worker",
    probe=probe_capture_gate,
    apply=apply_capture_gate,
    speculators=SPECULATORS_0_3_ONLY,
)


# ---- the base model of a multimodal wrapper ----------------------------------------------------------------
# speculators finds the decoder stack it re-binds as `model.model` (0.3.0) or, for a model with
# get_language_model(), `model.get_language_model().model` (0.4.x). A multimodal wrapper often has
# no `.model` (Kimi-K2.5, Llava: `.language_model`), and what get_language_model() returns differs
# between vLLM releases and models (the causal LM, or the base model itself). The base model is
# found by probing, and speculators' set-up sees a view of the wrapper whose `.model` and
# `.get_language_model().model` are it; a model where speculators' own lookup works is untouched.


def _text_base(candidate: Any) -> Any:
    """``candidate.model`` when it is a decoder stack (a causal LM), ``candidate`` when it is one."""
    if candidate is None:
        return None
    inner = getattr(candidate, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner
    return candidate if hasattr(candidate, "layers") else None


def find_base_model(model: Any) -> Any:
    """The decoder stack (a module with ``layers``) of a causal LM or of a multimodal wrapper.

    Tried in order: ``model.model``; what ``model.get_language_model()`` returns (a causal LM or
    the base model); the one direct child module that is or holds a decoder stack. None when
    nothing (or more than one child) qualifies."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner
    get_language_model = getattr(model, "get_language_model", None)
    if callable(get_language_model):
        try:
            language_model = get_language_model()
        except Exception:  # noqa: BLE001 - abstract or unset on some releases/models: probe the children
            language_model = None
        base = _text_base(language_model)
        if base is not None:
            return base
    named_children = getattr(model, "named_children", None)
    if callable(named_children):
        found = [base for _, child in named_children() if (base := _text_base(child)) is not None]
        if len(found) == 1:
            return found[0]
    return None


class WrapperView(wrapt.ObjectProxy):  # type: ignore[type-arg, misc]
    """A multimodal wrapper as speculators' capture set-up reads it: ``.model`` and
    ``.get_language_model().model`` are the text base model; every other attribute is the wrapper's."""

    def __init__(self, wrapper: Any, base: Any) -> None:
        super().__init__(wrapper)
        self._self_model = base

    @property
    def model(self) -> Any:
        return self._self_model

    def get_language_model(self) -> Any:
        return self  # its `.model` is the base model


def _speculators_lookup_works(model: Any, reads_language_model: bool) -> bool:
    """Whether speculators' own expression for the base model gives a module with ``layers``."""
    try:
        if reads_language_model and hasattr(model, "get_language_model"):
            base = model.get_language_model().model
        else:
            base = model.model
    except Exception:  # noqa: BLE001 - AttributeError / NotImplementedError: the lookup fails
        return False
    return hasattr(base, "layers")


def _setup_reads(worker: Any) -> set[str]:
    setup = vars(worker.HiddenStatesWorkerExtension)["_setup_hidden_states_capture"]
    return speculators_code.attribute_names_used(setup) & {"model", "get_language_model"}


def probe_wrapper_base_model(ctx: Context) -> Probe:
    reads = _setup_reads(worker_module(ctx))
    if "model" not in reads:
        return Probe(False, "speculators' capture set-up does not look up a base model")
    how = "model.get_language_model().model or model.model" if "get_language_model" in reads else "model.model"
    return Probe(
        True, f"speculators finds the base model as {how}; a multimodal wrapper's is found by probing at set-up"
    )


def apply_wrapper_base_model(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    extension_cls, original = extension_method(ctx, "_setup_hidden_states_capture")
    reads_language_model = "get_language_model" in _setup_reads(worker)

    @functools.wraps(original)
    def _setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> Any:
        runner = self.model_runner
        model = runner.model
        if _speculators_lookup_works(model, reads_language_model):
            return original(self, layer_ids)
        base = find_base_model(model)
        if base is None:
            return original(self, layer_ids)  # speculators' own error names the model
        logger.info("spec_compat: %s: capturing from its text model %s", type(model).__name__, type(base).__name__)
        runner.model = WrapperView(model, base)
        try:
            return original(self, layer_ids)
        finally:
            runner.model = model

    patcher.replace(extension_cls, "_setup_hidden_states_capture", _setup_hidden_states_capture)


WRAPPER_BASE_MODEL = Adapter(
    id="wrapper-base-model",
    notes="""
    why: capture set-up of a multimodal wrapper fails: AttributeError: 'KimiK25ForConditionalGeneration' object has no
        attribute 'model' (0.3.0 reads model.model; 0.4.x get_language_model().model, whose shape differs between
        releases and models)
    vllm change: none for one release: multimodal wrappers keep their text model as `.language_model`
        (KimiK25ForConditionalGeneration in 0.32.0, Llava-style models), not `.model`; what get_language_model()
        (SupportsMultiModal) returns depends on the release and the model
    detect: AST: which of model / get_language_model the set-up reads; at set-up: whether that lookup gives a module
        with `layers`, else the base model found by probing (get_language_model(), then the one child holding a decoder
        stack)
    delete when: speculators finds the base model through vLLM's own interface for every model
    patches: custom_worker.HiddenStatesWorkerExtension._setup_hidden_states_capture
    """,
    side="worker",
    probe=probe_wrapper_base_model,
    apply=apply_wrapper_base_model,
)


# ---- capture set-up checks and the embed-method rename -------------------------------------------------
# vLLM 0.11.2 renamed get_input_embeddings -> embed_input_ids on base models. The name the
# installed speculators' forward calls is aliased on the captured model instance only.

EMBED_NAMES = ("embed_input_ids", "get_input_embeddings")


def _embed_name_called(worker: Any) -> str | None:
    used = speculators_code.attribute_names_used(worker._patched_forward)
    return next((name for name in EMBED_NAMES if name in used), None)


def probe_embed_alias(ctx: Context) -> Probe:
    called = _embed_name_called(worker_module(ctx))
    if called is None:
        return Probe(False, "speculators' forward calls no embedding method")
    from vllm.model_executor.models import interfaces_base

    has = any(hasattr(interfaces_base.VllmModel, n) for n in (called,))
    if has:
        return Probe(True, f"speculators calls {called}(); aliased on models that only have the other name")
    return Probe(True, f"speculators calls {called}(), which this vLLM's model interface does not define")


def _setup_checks(extension: Any, base: Any) -> None:
    runner = extension.model_runner
    hf_config = getattr(getattr(runner, "model_config", None), "hf_config", None)
    if getattr(hf_config, "llama_4_scaling", None):
        raise NotImplementedError(
            "this checkpoint sets llama_4_scaling, which the model's own forward passes to every layer; "
            "speculators' capture forward does not, so its hidden states would be wrong"
        )
    sharded = [
        name for name, module in base.named_modules() if getattr(module, "use_sequence_parallel_moe", False) is True
    ]
    if sharded:
        raise NotImplementedError(
            f"sequence-parallel MoE is on ({sharded[:3]}...): layers return token shards that the model "
            "re-gathers and speculators' capture forward does not; disable expert/sequence parallelism"
        )


def apply_capture_setup(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    extension_cls, original = extension_method(ctx, "_setup_hidden_states_capture")
    called = _embed_name_called(worker)
    reads_input_batch = "input_batch" in speculators_code.attribute_names_used(extension_cls._store_captured_states)

    @functools.wraps(original)
    def _setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> Any:
        result = original(self, layer_ids)
        base = _base_model(self.model_runner.model)
        if called is not None and base is not None and not hasattr(base, called):
            other = next((n for n in EMBED_NAMES if n != called and hasattr(base, n)), None)
            if other is None:
                raise AttributeError(f"{type(base).__name__} has neither {called}() nor any known embedding method")
            setattr(base, called, getattr(base, other))
        if reads_input_batch and not hasattr(self.model_runner, "input_batch"):
            raise NotImplementedError(
                f"{type(self.model_runner).__name__} has no input_batch (Model Runner V2); speculators' "
                "capture needs the V1 runner: unset VLLM_USE_V2_MODEL_RUNNER or set it to 0"
            )
        if base is not None:
            _setup_checks(self, base)
        return result

    patcher.replace(extension_cls, "_setup_hidden_states_capture", _setup_hidden_states_capture)


CAPTURE_SETUP = Adapter(
    id="capture-setup",
    notes="""
    why: the embedding method was renamed; Model Runner V2, llama_4_scaling and sequence-parallel MoE make speculators'
        capture wrong or crash later: alias the name, refuse the rest at set-up
    vllm change: 0.11.2 get_input_embeddings -> embed_input_ids; 0.12.0 llama_4_scaling (DeepseekV2); 0.22.1 Model
        Runner V2 default on GPU; 0.25.1 token-sharded DeepseekV2 layers
    detect: AST: which embedding name speculators' forward calls, and whether it reads input_batch
    delete when: speculators' capture forward is replaced by vLLM-native aux hidden-state capture
    patches: custom_worker.HiddenStatesWorkerExtension._setup_hidden_states_capture
    """,
    side="worker",
    probe=probe_embed_alias,
    apply=apply_capture_setup,
    # checks (and aliases the embedding on) the base model that wrapper-base-model's set-up captured from
    after=("wrapper-base-model",),
)


# ---- extra layer keywords (vLLM 0.15.1: forward(..., **extra_layer_kwargs)) ------------------------------
# The model's own forward hands extra keywords to every decoder layer; speculators 0.4's capture
# forward swallows them (0.3.0's rejects them). Bind them to the layers for that one forward.


def probe_layer_kwargs(ctx: Context) -> Probe:
    return Probe(True, "models may pass extra keywords to their layers (LlamaModel since vLLM 0.15.1)")


def apply_layer_kwargs(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    original = worker._patched_forward

    @functools.wraps(original)
    def _patched_forward(
        self: Any,
        input_ids: Any,
        positions: Any,
        intermediate_tensors: Any = None,
        inputs_embeds: Any = None,
        **kwargs: Any,
    ) -> Any:
        extra = {k: v for k, v in kwargs.items() if v is not None}
        if not extra:
            return original(self, input_ids, positions, intermediate_tensors, inputs_embeds)
        layers = list(islice(self.layers, self.start_layer, self.end_layer))
        accepted = {k: v for k, v in extra.items() if all(_layer_accepts(layer, k) for layer in layers)}
        ignored = sorted(set(extra) - set(accepted))
        if ignored:
            warnings.warn(
                f"spec_compat: keywords {ignored} are not decoder-layer keywords; not passed to layers", stacklevel=2
            )
        for layer in layers:
            layer.forward = functools.partial(type(layer).forward, layer, **accepted)
        try:
            return original(self, input_ids, positions, intermediate_tensors, inputs_embeds)
        finally:
            for layer in layers:
                del layer.forward

    patcher.replace(worker, "_patched_forward", _patched_forward)


LAYER_KWARGS = Adapter(
    id="layer-kwargs",
    notes="""
    why: the model's forward hands extra keywords to every layer; speculators' capture forward drops (0.4) or rejects
        (0.3) them
    vllm change: 0.15.1 LlamaModel.forward(..., **extra_layer_kwargs)
    detect: at run time: the forward receives non-None extra keywords
    delete when: speculators' capture forward passes layer keywords through
    patches: custom_worker._patched_forward
    """,
    side="worker",
    probe=probe_layer_kwargs,
    apply=apply_layer_kwargs,
)


@functools.lru_cache(maxsize=64)
def _class_accepts(layer_type: Any, name: str) -> bool:
    params = inspect.signature(layer_type.forward).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _layer_accepts(layer: Any, name: str) -> bool:
    layer_type: Any = type(layer)
    return _class_accepts(layer_type, name)


# ---- batch order log (speculators 0.3.0 slices by input offsets) ----------------------------------------


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
    notes="""
    why: 0.3.0 slices captures by input offsets assuming the runner batched requests in input order
    vllm change: none: a latent speculators 0.3.0 assumption, verified instead of trusted
    detect: AST: _store_captured_states does not read model_runner.input_batch
    delete when: speculators 0.3.0 is no longer supported
    patches: HiddenStatesWorkerExtension._store_captured_states, HiddenStatesWorkerExtension._spec_compat_take_batch_log
        (added)
    """,
    side="worker",
    probe=probe_batch_order_log,
    apply=apply_batch_order_log,
    speculators=SPECULATORS_0_3_ONLY,
)


# ---- captured states through shared memory (the worker's half of executor-shared-memory-replies) ----------


def probe_shared_memory_states(ctx: Context) -> Probe:
    extension = worker_module(ctx).HiddenStatesWorkerExtension
    if "_get_captured_states" not in vars(extension):
        return Probe(False, "speculators' worker has no _get_captured_states")
    return Probe(True, "captured states leave the worker in shared memory (NaN/Inf checked on the device), not pickled")


def apply_shared_memory_states(ctx: Context, patcher: AdapterPatcher) -> None:
    extension_cls, original = extension_method(ctx, "_get_captured_states")

    @functools.wraps(original)
    def _get_captured_states(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        directory = os.environ.get(transfer.TRANSFER_DIR_ENV)
        if result is None or not directory:
            return result  # not started by spec_compat's executor (or its transfer is off): as speculators does
        pool = self.__dict__.get("_spec_compat_segments")
        if pool is None or pool.directory != directory:
            pool = transfer.SegmentPool(directory, f"rank{tp_rank()}-pid{os.getpid()}")
            self._spec_compat_segments = pool
        return transfer.pack(result, pool)

    patcher.replace(extension_cls, "_get_captured_states", _get_captured_states)


CAPTURED_STATES_SHARED_MEMORY = Adapter(
    id="captured-states-shared-memory",
    notes="""
    why: the reply (~500 MB for 32k tokens x 4 layers) was pickled tensor by tensor through vLLM's message queue and the
        driver checked NaN/Inf on the CPU: 12k tok/s where vLLM extracts 153k on one H200 (GPU_NOTES 'Turn-2
        measurements')
    vllm change: none: all releases send RPC replies by pickling them
    detect: the worker defines _get_captured_states; active only in workers whose driver set the transfer directory
        (executor-shared-memory-replies)
    delete when: vLLM offers a zero-copy tensor channel from workers to the driver
    patches: HiddenStatesWorkerExtension._get_captured_states (reply through a shared-memory segment)
    """,
    side="worker",
    probe=probe_shared_memory_states,
    apply=apply_shared_memory_states,
)
