"""Adapter ``request-kwargs``: Request(eos_token_id=..., block_hasher=...)."""

from __future__ import annotations

from ...calls import KeywordPlan, accepts, innermost
from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..speculators_code import generator_module
from ..support import install_call_adapter, passes_keyword
from ..unit import Adapter

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
    patches=("speculators.data_generation.vllm_hidden_states_generator.Request",),
    how="keywords eos_token_id, block_hasher",
    why="TypeError: Request.__init__() got an unexpected keyword argument 'eos_token_id'",
    vllm_change="0.17.0 removed Request(eos_token_id=) (EOS moved into SamplingParams)",
    detect="signature: keywords speculators passes that Request.__init__ does not accept",
    delete_when="speculators stops passing eos_token_id",
    side="driver",
    probe=probe_request_kwargs,
    apply=apply_request_kwargs,
)
