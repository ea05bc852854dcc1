"""Helpers shared by more than one adapter file (the only module in adapters/ that is not one
adapter, a side package or a library module): the worker's rank and base-model lookup, the
generator-module call adapters, the generate() wrappers' plumbing, the watchdog's directory and
signal. No adapter is defined here."""

from __future__ import annotations

import functools
import inspect
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import wrapt

from ..calls import CallAdapter, KeywordPlan, accepts, innermost, required
from ..options import Context
from ..patching import AdapterPatcher
from ..timing import OwnTime
from .probe import Probe
from .speculators_code import call_sites, generator_module


def tp_rank() -> int | None:
    try:
        from vllm.distributed import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - no process group (yet): rank unknown
        return None


def base_model(model: Any) -> Any:
    return find_base_model(model)


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


@functools.lru_cache(maxsize=64)
def class_accepts(layer_type: Any, name: str) -> bool:
    params = inspect.signature(layer_type.forward).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def layer_accepts(layer: Any, name: str) -> bool:
    layer_type: Any = type(layer)
    return class_accepts(layer_type, name)


WATCHDOG_DIR_ENV = "SPEC_COMPAT_WATCHDOG_DIR"  # set while spec_compat's executor starts its workers
STACK_SIGNAL: int | None = getattr(signal, "SIGUSR2", None)


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


GeneratorMethod = Callable[..., Any]
# The generate a wrapper wraps, called on a batch with the caller's other arguments (wrap_generate).
Run = Callable[[Any], Any]


def wrap_method(
    ctx: Context, patcher: AdapterPatcher, name: str, make: Callable[[GeneratorMethod], GeneratorMethod]
) -> None:
    """Install ``make(original)`` as ``name`` (a ``wrapt.FunctionWrapper``: the original's name,
    signature and descriptor binding are kept); the time it spends outside ``original`` is
    accounted as ``own:<adapter id>`` (``spec_compat.timings()``)."""
    cls = generator_module(ctx).VllmHiddenStatesGenerator
    original = getattr(cls, name)  # an earlier adapter's wrapper, bound to the class: called with self
    own = OwnTime(f"own:{patcher.adapter_id}")

    def timed_original(*args: Any, **kwargs: Any) -> Any:
        with own.excluded():
            return original(*args, **kwargs)

    body = make(timed_original)

    def call(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with own.around():
            return body(*args, **kwargs) if instance is None else body(instance, *args, **kwargs)

    patcher.replace(cls, name, wrapt.FunctionWrapper(vars(cls).get(name, original), call))


def wrap_generate(ctx: Context, patcher: AdapterPatcher, body: Callable[[Any, Any, Run], Any]) -> None:
    """Install ``body(generator, token_ids, run)`` as ``generate`` (through ``wrap_method``):
    ``run(batch)`` calls the generate it wraps on ``batch`` with the caller's other arguments."""

    def make(original: GeneratorMethod) -> GeneratorMethod:
        def generate(self: Any, token_ids: Any, *args: Any, **kwargs: Any) -> Any:
            return body(self, token_ids, lambda batch: original(self, batch, *args, **kwargs))

        return generate

    wrap_method(ctx, patcher, "generate", make)


def run_in_parts(run: Run, parts: Iterable[Any]) -> list[Any]:
    """The results of ``run`` on each part, in order, as one list."""
    return [result for part in parts for result in run(part)]


def max_prompt_len(generator: Any) -> int:
    return int(generator.vllm_config.model_config.max_model_len) - 1  # max_tokens=1 must still fit


def as_run(generator: Any, token_ids: Sequence[Any]) -> list[list[int]]:
    """The inputs as speculators runs them: each cut to max_model_len - 1 tokens (a list that fits is
    passed on as it is, read only, so its int64 key from input-validation is found again)."""
    limit = max_prompt_len(generator)
    return [ids if type(ids) is list and len(ids) <= limit else list(ids)[:limit] for ids in token_ids]
