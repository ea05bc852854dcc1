"""Wrappers around ``VllmHiddenStatesGenerator.__init__`` / ``generate``: checks and ordering.

They patch speculators' own class, so vLLM is untouched. Each wrapper is a separate registry
adapter (a ``wrapt.FunctionWrapper``); the wrapped originals stay reachable through ``__wrapped__``.
"""

from __future__ import annotations

import ast
import math
import warnings
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import wrapt

from ..errors import IncompatibleError
from ..options import Context
from ..patching import AdapterPatcher
from ..timing import OwnTime
from . import speculators_code
from .contract import check_results
from .probe import Probe
from .speculators_code import generator_module
from .unit import SPECULATORS_0_3_ONLY, SPECULATORS_0_4_ONLY, Adapter

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


# ---- input validation ---------------------------------------------------------------------------------


def _vocab_size(generator: Any) -> int | None:
    model_config = generator.vllm_config.model_config
    getter = getattr(model_config, "get_vocab_size", None)
    try:
        return int(getter()) if getter is not None else int(model_config.hf_text_config.vocab_size)
    except Exception:  # noqa: BLE001 - unknown vocabulary: skip the range check, not the others
        return None


def normalise_token_ids(token_ids: Any, vocab_size: int | None) -> list[list[int]]:
    """The batch as lists of ints, or a ValueError/TypeError that names the bad element."""
    import torch

    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids tensor must be 2-D [batch, tokens], got shape {list(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids tensor must have an integer dtype, got {token_ids.dtype}")
        rows: list[Any] = token_ids.tolist()
    elif isinstance(token_ids, (list, tuple)):
        rows = list(token_ids)
    else:
        raise TypeError(
            f"token_ids must be a list of token-id sequences or a 2-D tensor, got {type(token_ids).__name__}"
        )
    if not rows:
        raise ValueError("token_ids is empty: pass at least one sequence")
    batch: list[list[int]] = []
    for i, row in enumerate(rows):
        if isinstance(row, torch.Tensor):
            if row.ndim != 1 or row.dtype.is_floating_point or row.dtype == torch.bool:
                raise TypeError(f"token_ids[{i}] must be a 1-D integer tensor, got {row.dtype} shape {list(row.shape)}")
            row = row.tolist()
        if not isinstance(row, (list, tuple)):
            raise TypeError(f"token_ids[{i}] must be a sequence of ints, got {type(row).__name__}")
        if len(row) == 0:
            raise ValueError(f"token_ids[{i}] is empty: every sequence needs at least one token")
        if set(map(type, row)) == {int} and min(row) >= 0 and (vocab_size is None or max(row) < vocab_size):
            batch.append(list(row))  # the common case, checked in C loops; the loop below names a bad token
            continue
        for j, token in enumerate(row):
            if isinstance(token, bool) or not isinstance(token, int):
                raise TypeError(f"token_ids[{i}][{j}] = {token!r} is not an int")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"token_ids[{i}][{j}] = {token} is outside the vocabulary [0, {vocab_size})")
        batch.append(list(row))
    return batch


def _max_prompt_len(generator: Any) -> int:
    return int(generator.vllm_config.model_config.max_model_len) - 1  # max_tokens=1 must still fit


def _as_run(generator: Any, token_ids: Sequence[Any]) -> list[list[int]]:
    """The inputs as speculators runs them: each cut to max_model_len - 1 tokens."""
    limit = _max_prompt_len(generator)
    return [list(ids)[:limit] for ids in token_ids]


def _refuse_unschedulable(generator: Any, lengths: list[int]) -> None:
    """Without chunked prefill a prompt longer than one step's token budget is never scheduled:
    the generator would stop with its states missing. vLLM turns chunked prefill off by itself
    for some models (MLA on CPU), so this is checked per call."""
    scheduler = getattr(generator, "scheduler", None)
    config = getattr(scheduler, "scheduler_config", None)
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    if config is None or budget is None or getattr(config, "enable_chunked_prefill", True):
        return
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise ValueError(
            f"sequences {too_long[:10]} are longer than one scheduler step ({budget} tokens) and vLLM "
            "has chunked prefill off for this model: they would never be scheduled. Raise "
            "max_num_batched_tokens to at least the longest prompt"
        )


def probe_input_validation(ctx: Context) -> Probe:
    return Probe(True, "generate() would send malformed or out-of-vocabulary ids into the engine")


def apply_input_validation(ctx: Context, patcher: AdapterPatcher) -> None:
    def validated(generator: Any, token_ids: Any, run: Run) -> Any:
        batch = normalise_token_ids(token_ids, _vocab_size(generator))
        limit = _max_prompt_len(generator)
        _refuse_unschedulable(generator, [min(len(ids), limit) for ids in batch])
        too_long = [i for i, ids in enumerate(batch) if len(ids) > limit]
        if too_long:
            warnings.warn(
                f"{len(too_long)} sequence(s) (indices {too_long[:10]}) are longer than "
                f"max_model_len - 1 = {limit} tokens and are truncated to it, as speculators does",
                stacklevel=2,
            )
        return run(batch)

    wrap_generate(ctx, patcher, validated)


INPUT_VALIDATION = Adapter(
    id="input-validation",
    notes="""
    why: empty, negative, non-integer or out-of-vocabulary ids fail deep inside the engine or not at all
    vllm change: none: a guard
    detect: always
    delete when: never
    patches: VllmHiddenStatesGenerator.generate (input checks before vLLM is touched)
    """,
    side="driver",
    probe=probe_input_validation,
    apply=apply_input_validation,
    # outside every other generate wrapper: they all take the lists of ints it makes of token_ids
    after=("single-step-batches", "sequence-limit", "input-order", "layer-ids", "results-contract"),
)


# ---- layer ids ------------------------------------------------------------------------------------------
# Both speculators versions keep layer ids in a frozenset and capture in model order: duplicates
# come back once and an unsorted list comes back sorted, so hidden_states[k] would silently not be
# layer_ids[k].


def probe_layer_ids(ctx: Context) -> Probe:
    return Probe(True, "captures come back once per distinct layer, in ascending layer order")


def layer_ids_problem(layer_ids: Sequence[Any], defaulted: bool) -> str | None:
    """Why this selection cannot be captured as asked (None: it can); one line, says how to fix it."""
    layer_ids = list(layer_ids)
    source = "speculators' default layer_ids for this model" if defaulted else "layer_ids"
    how = "pass layer_ids=[...] with distinct decoder layer ids (spec-compat extract: --layer-ids 2,5,9)"
    bad = [x for x in layer_ids if isinstance(x, bool) or not isinstance(x, int)]
    if bad:
        return f"{source} {layer_ids}: {bad} are not ints; {how}"
    if not layer_ids:
        return f"{source} is empty: {how}"
    duplicates = sorted({x for x in layer_ids if layer_ids.count(x) > 1})
    if duplicates:
        return f"{source} {layer_ids} repeat {duplicates} (each layer is captured once: fewer tensors come back); {how}"
    return None


def apply_layer_ids(ctx: Context, patcher: AdapterPatcher) -> None:
    def make_init(original: GeneratorMethod) -> GeneratorMethod:
        def __init__(
            self: Any, model_path: str, layer_ids: Sequence[int] | None = None, *args: Any, **kwargs: Any
        ) -> None:
            if layer_ids is not None:
                layer_ids = list(layer_ids)
                problem = layer_ids_problem(layer_ids, defaulted=False)
                if problem:
                    raise (TypeError if "not ints" in problem else ValueError)(problem)
            self._spec_compat_layer_ids_defaulted = layer_ids is None
            original(self, model_path, layer_ids, *args, **kwargs)

        return __init__

    def make_create_config(original: GeneratorMethod) -> GeneratorMethod:
        # Both speculators versions choose their default ([2, n // 2, n - 3, n - 1], which repeats
        # ids below 8 layers) and range-check it right before building the vLLM config: the last
        # moment before the executor loads weights at which self.layer_ids is known.
        def _create_vllm_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            layer_ids = getattr(self, "layer_ids", None)
            if layer_ids is not None:
                problem = layer_ids_problem(layer_ids, getattr(self, "_spec_compat_layer_ids_defaulted", False))
                if problem:
                    raise ValueError(problem)
            return original(self, *args, **kwargs)

        return _create_vllm_config

    def in_requested_order(generator: Any, token_ids: Any, run: Run) -> Any:
        results = run(token_ids)
        requested = list(generator.layer_ids)
        captured = sorted(requested)
        if requested == captured or not isinstance(results, list):
            return results
        position = {layer: k for k, layer in enumerate(captured)}
        for result in results:
            states = result.get("hidden_states") if isinstance(result, dict) else None
            if isinstance(states, list) and len(states) == len(captured):
                result["hidden_states"] = [states[position[layer]] for layer in requested]
        return results

    wrap_method(ctx, patcher, "__init__", make_init)
    if hasattr(generator_module(ctx).VllmHiddenStatesGenerator, "_create_vllm_config"):
        wrap_method(ctx, patcher, "_create_vllm_config", make_create_config)
    wrap_generate(ctx, patcher, in_requested_order)


LAYER_IDS = Adapter(
    id="layer-ids",
    notes="""
    why: duplicates come back once and an unsorted list comes back sorted: hidden_states[k] is not layer_ids[k];
        speculators' default for a model under 8 layers repeats ids (6 layers: [2, 3, 3, 5])
    vllm change: none: speculators keeps layer ids in a frozenset
    detect: always
    delete when: speculators validates and orders layer ids
    patches: VllmHiddenStatesGenerator.__init__ and _create_vllm_config (reject duplicates, given or speculators'
        default, before the weights load) and generate (requested layer order)
    """,
    side="driver",
    probe=probe_layer_ids,
    apply=apply_layer_ids,
    # generate: the layers of the whole batch's results, once, after the splitting and reordering wrappers
    after=("single-step-batches", "sequence-limit", "input-order"),
)


# ---- results in input order (speculators 0.4.x sorts request ids as strings) ---------------------------


def _sorts_request_ids(generate: GeneratorMethod) -> bool:
    tree = speculators_code.tree_of(generate)
    return any(
        isinstance(node, ast.For)
        and isinstance(node.iter, ast.Call)
        and isinstance(node.iter.func, ast.Name)
        and node.iter.func.id == "sorted"
        for node in ast.walk(tree)
    )


def probe_input_order(ctx: Context) -> Probe:
    if _sorts_request_ids(generator_module(ctx).VllmHiddenStatesGenerator.generate):
        return Probe(True, "generate() returns results in sorted(request_id) order: 'req_0_10' < 'req_0_2'")
    return Probe(False, "generate() returns results in input order")


def _ids_key(ids: Any) -> bytes:
    """The token ids as int64 bytes: an exact key that hashes and compares in C."""
    import torch

    if isinstance(ids, torch.Tensor):
        return bytes(ids.to(torch.int64).contiguous().numpy().tobytes())
    return array("q", ids).tobytes()


def reorder_to_inputs(results: list[Any], inputs: list[list[int]]) -> list[Any]:
    """Put results back in input order by their input_ids (equal inputs are interchangeable)."""
    by_ids: defaultdict[bytes, deque[Any]] = defaultdict(deque)
    for result in results:
        by_ids[_ids_key(result["input_ids"])].append(result)
    ordered = []
    for ids in inputs:
        queue = by_ids.get(_ids_key(ids))
        if not queue:
            return results  # leave it to the contract check to say what is wrong
        ordered.append(queue.popleft())
    return ordered


def apply_input_order(ctx: Context, patcher: AdapterPatcher) -> None:
    def in_input_order(generator: Any, token_ids: list[list[int]], run: Run) -> Any:
        results = run(token_ids)
        if not isinstance(results, list) or not all(isinstance(r, dict) and "input_ids" in r for r in results):
            return results
        return reorder_to_inputs(results, _as_run(generator, token_ids))

    wrap_generate(ctx, patcher, in_input_order)


INPUT_ORDER = Adapter(
    id="input-order",
    notes="""
    why: results come back in sorted(request_id) order: 'req_0_10' < 'req_0_2', batches of 11+ permuted
    vllm change: none: speculators 0.4.x bug (speculators PR #365)
    detect: AST: generate() iterates sorted(...)
    delete when: speculators returns results in input order
    patches: VllmHiddenStatesGenerator.generate (results back in input order)
    """,
    side="driver",
    probe=probe_input_order,
    apply=apply_input_order,
    # once over the whole batch's results, after the splitting wrappers joined their parts
    after=("single-step-batches", "sequence-limit"),
    speculators=SPECULATORS_0_4_ONLY,
)


# ---- batches larger than the scheduler's sequence limit ----------------------------------------------
# speculators never reports model outputs to the scheduler (no update_from_output), so a request
# that finished its prefill is never finished: it keeps one of the max_num_seqs (32) running slots
# and the requests beyond the first max_num_seqs are never scheduled ("Request ... not found").


def probe_sequence_limit(ctx: Context) -> Probe:
    generate = generator_module(ctx).VllmHiddenStatesGenerator.generate
    if speculators_code.calls_method(generate, "update_from_output"):
        return Probe(False, "generate() reports outputs to the scheduler, which frees finished requests")
    return Probe(True, "generate() never frees finished requests: inputs beyond max_num_seqs would never be scheduled")


def apply_sequence_limit(ctx: Context, patcher: AdapterPatcher) -> None:
    def in_running_slots(generator: Any, token_ids: list[list[int]], run: Run) -> Any:
        limit = int(getattr(generator.scheduler, "max_num_running_reqs", 0) or len(token_ids))
        if len(token_ids) <= limit:
            return run(token_ids)
        return run_in_parts(run, (token_ids[start : start + limit] for start in range(0, len(token_ids), limit)))

    wrap_generate(ctx, patcher, in_running_slots)


SEQUENCE_LIMIT = Adapter(
    id="sequence-limit",
    notes="""
    why: requests beyond max_num_seqs (32) are never scheduled: 'Request req_0_32 not found in captured states' for a
        batch of 48
    vllm change: none: speculators never calls scheduler.update_from_output, so prefilled requests keep their running
        slot (found on the H200 with a 48-prompt batch)
    detect: AST: generate() does not call update_from_output
    delete when: speculators frees finished requests or splits batches itself
    patches: VllmHiddenStatesGenerator.generate (sub-batches of at most max_num_seqs inputs)
    """,
    side="driver",
    probe=probe_sequence_limit,
    apply=apply_sequence_limit,
    # each part that fits the running slots is planned into single steps (0.3.0)
    after=("single-step-batches",),
)


# ---- speculators 0.3.0: one scheduler step per call --------------------------------------------------
# 0.3.0 aborts every request after its first scheduled chunk and slices one concatenated capture by
# input offsets. That is right only if every prompt is prefilled whole, in one step, in input
# order. Split the batch into sub-batches that fit one step, and verify what ran.


def probe_single_step(ctx: Context) -> Probe:
    generate = generator_module(ctx).VllmHiddenStatesGenerator.generate
    if speculators_code.finishes_requests_inside_schedule_loop(generate):
        return Probe(
            True, "generate() aborts every request after its first scheduled chunk (and slices by input offsets)"
        )
    return Probe(False, "generate() finishes requests only after the schedule loop")


def plan_single_step_batches(
    lengths: Sequence[int], max_tokens: int, max_seqs: int, max_kv_tokens: int | None, block_size: int
) -> list[list[int]]:
    """Greedy split of input indices into runs that one scheduler step prefills whole."""
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = blocks = 0
    for index, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(
                f"sequence {index} has {length} tokens but one scheduler step takes at most {max_tokens} "
                "(max_num_batched_tokens); speculators 0.3.0 would silently keep only the first chunk. "
                "Raise max_num_batched_tokens or use speculators 0.4.x"
            )
        need_blocks = math.ceil((length + 1) / block_size)
        if max_kv_tokens is not None and need_blocks * block_size > max_kv_tokens:
            raise ValueError(f"sequence {index} ({length} tokens) does not fit the KV cache ({max_kv_tokens} tokens)")
        fits = (
            len(current) < max_seqs
            and tokens + length <= max_tokens
            and (max_kv_tokens is None or (blocks + need_blocks) * block_size <= max_kv_tokens)
        )
        if current and not fits:
            batches.append(current)
            current, tokens, blocks = [], 0, 0
        current.append(index)
        tokens += length
        blocks += need_blocks
    if current:
        batches.append(current)
    return batches


def _verify_single_step(executor: Any, request_lengths: list[int], steps_before: int) -> None:
    steps = executor.step_log[steps_before:]
    ran = [step for step in steps if step]
    if len(ran) != 1:
        raise IncompatibleError(f"expected the sub-batch to run in one scheduler step, it ran in {len(ran)}: {ran}")
    scheduled = [n for _, n in ran[0]]
    if scheduled != request_lengths:
        raise IncompatibleError(
            f"scheduler step did not prefill the sub-batch whole and in order: expected token counts "
            f"{request_lengths}, scheduled {scheduled}"
        )


def apply_single_step(ctx: Context, patcher: AdapterPatcher) -> None:
    def in_single_steps(generator: Any, token_ids: list[list[int]], run: Run) -> Any:
        batch = _as_run(generator, token_ids)
        scheduler = generator.scheduler
        cache_config = generator.vllm_config.cache_config
        num_blocks = getattr(cache_config, "num_gpu_blocks", None)
        block_size = int(cache_config.block_size)
        plan = plan_single_step_batches(
            [len(ids) for ids in batch],
            max_tokens=int(scheduler.max_num_scheduled_tokens),
            max_seqs=int(scheduler.max_num_running_reqs),
            max_kv_tokens=(int(num_blocks) - 1) * block_size if num_blocks else None,
            block_size=block_size,
        )

        def run_verified(sub_batch: list[list[int]]) -> Any:
            steps_before = len(getattr(generator.executor, "step_log", []))
            results = run(sub_batch)
            if hasattr(generator.executor, "step_log"):
                _verify_single_step(generator.executor, [len(ids) for ids in sub_batch], steps_before)
            _verify_worker_order(generator)
            return results

        return run_in_parts(run_verified, ([batch[i] for i in indices] for indices in plan))

    wrap_generate(ctx, patcher, in_single_steps)


SINGLE_STEP_BATCHES = Adapter(
    id="single-step-batches",
    notes="""
    why: 0.3.0 aborts requests after their first chunk and slices by input offsets: chunked prefill or a reordered batch
        gives wrong states silently
    vllm change: none: speculators 0.3.0 logic (fixed in 0.4 by speculators #283)
    detect: AST: generate() calls finish_requests and slices by offset
    delete when: speculators 0.3.0 is no longer supported
    patches: VllmHiddenStatesGenerator.generate (sub-batches of one scheduler step, verified)
    """,
    side="driver",
    probe=probe_single_step,
    apply=apply_single_step,
    speculators=SPECULATORS_0_3_ONLY,
)


def _verify_worker_order(generator: Any) -> None:
    """The worker's batch order for each capture must be the scheduler's (input) order."""
    try:
        logs = generator.executor.collective_rpc("_spec_compat_take_batch_log")
    except Exception:  # noqa: BLE001 - the worker adapter is not there: nothing to compare
        return
    log = logs[0] if isinstance(logs, list) and logs else None
    if not log:
        return
    steps = generator.executor.step_log
    expected = [req_id for req_id, _ in steps[-1]] if steps else None
    for worker_order in log:
        if not worker_order:
            continue  # a dummy/profile forward (vLLM's warm-up on GPU) carries no request
        if expected is not None and [r for r in worker_order if r is not None] != expected:
            raise IncompatibleError(
                f"the worker batched requests in order {worker_order}, the scheduler in {expected}: "
                "speculators 0.3.0 would slice states of the wrong requests"
            )


# ---- results contract -----------------------------------------------------------------------------------


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
            _as_run(generator, token_ids),
            list(generator.layer_ids),
            _hidden_size(generator),
            check_finite=not worker_checked,
        )
        return results

    wrap_generate(ctx, patcher, checked)


RESULTS_CONTRACT = Adapter(
    id="results-contract",
    notes="""
    why: wrong shapes or orders must never pass silently (771 x [512] instead of 4 x [771, 7168])
    vllm change: none: a guard
    detect: apply(check_results=True), the default
    delete when: never
    patches: VllmHiddenStatesGenerator.generate (output contract check)
    """,
    side="driver",
    probe=probe_results_contract,
    apply=apply_results_contract,
    # checks what the caller gets: the whole batch, in input order, layers in the requested order
    after=("single-step-batches", "sequence-limit", "input-order", "layer-ids"),
)
