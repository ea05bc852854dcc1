"""Adapter ``block-hashes-off``: no prefix-cache hashes for requests whose blocks are never cached.

speculators 0.4.x builds vLLM's request block hasher (``get_request_block_hasher``, as vLLM's engine
core does) and passes it to every ``Request``: each request then hashes every full block of its
prompt (sha256 over the pickled tokens of 16-token blocks) when it is made. speculators' engine runs
with prefix caching off (``enable_prefix_caching=False``) and no KV connector, so nothing reads those
hashes: vLLM's own engine core makes no hasher in that case. They cost the driver 3.7 ms per call of
32 prompts of 928 tokens (0.12 us a token, measured on the 2-core development CPU with vLLM 0.32.0),
while the GPU waits (H100, run Z: a 29.7k-token call's forward took 0.196 s; 1.9 % of it).

Here a generator whose engine will never read them gets ``block_hasher = None`` after its
``__init__``: its requests carry no hashes, the forward and the captured states are the same bits
(tests/test_transfer_engine.py compares them with the adapter off). Only the instance attribute of
speculators' own generator changes; vLLM's engines elsewhere in the process are untouched.
"""

from __future__ import annotations

from typing import Any

from ...calls import accepts, innermost
from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..speculators_code import generator_module
from ..support import GeneratorMethod, wrap_method
from ..unit import Adapter


def hashes_read_by(vllm_config: Any) -> str | None:
    """What in this engine's configuration reads request block hashes, or None when nothing does."""
    if getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", True):
        return "prefix caching"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "a KV connector"
    events = getattr(vllm_config, "kv_events_config", None)
    if events is not None and getattr(events, "enable_kv_cache_events", False):
        return "KV cache events"
    return None


def probe_block_hashes_off(ctx: Context) -> Probe:
    module = generator_module(ctx)
    if not hasattr(module, "get_request_block_hasher"):
        return Probe(False, "speculators builds no request block hasher")
    if not accepts(innermost(module.Request), "block_hasher"):
        return Probe(False, "Request takes no block_hasher")
    return Probe(True, "speculators hashes every prompt block for prefix caching, which its engine keeps off")


def apply_block_hashes_off(ctx: Context, patcher: AdapterPatcher) -> None:
    def make(original: GeneratorMethod) -> GeneratorMethod:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if getattr(self, "block_hasher", None) is not None and hashes_read_by(self.vllm_config) is None:
                self.block_hasher = None

        return __init__

    wrap_method(ctx, patcher, "__init__", make)


BLOCK_HASHES_OFF = Adapter(
    id="block-hashes-off",
    patches=("speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.__init__",),
    how="after __init__: block_hasher = None when neither prefix caching, a KV connector nor KV events read hashes",
    why=(
        "every generate() call hashes each 16-token block of every prompt on the driver (3.7 ms for 30k tokens) "
        "while the GPU waits; nothing reads the hashes: the engine has prefix caching off and no KV connector"
    ),
    vllm_change=(
        "none: speculators 0.4.x builds and passes vLLM's request block hasher whatever enable_prefix_caching is"
    ),
    detect=(
        "speculators' module imports get_request_block_hasher and Request accepts block_hasher; per generator: "
        "its VllmConfig has prefix caching off, no kv_transfer_config and no KV cache events"
    ),
    delete_when="speculators passes a block hasher only when its engine caches prefixes",
    side="driver",
    probe=probe_block_hashes_off,
    apply=apply_block_hashes_off,
)
