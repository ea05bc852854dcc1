"""Adapter ``rpc-reply-read-once``: driver memory while speculators clones the captured states.

speculators 0.4.x clones every tensor of ``reply[req_id]`` in a loop while the whole reply stays
referenced until generate() returns, so the driver holds two copies of everything at the end. A
dict reply of speculators' RPCs becomes a mapping whose entries are released when read.
"""

from __future__ import annotations

from typing import Any

from ....options import Context
from ....patching import AdapterPatcher
from ... import speculators_code
from ...probe import Probe
from ...unit import Adapter
from .executor import install_hook
from .hooks import CORE_STAGE, ExecutorHook, RpcCall


class ReadOnceReply(dict):  # type: ignore[type-arg]
    """A reply mapping whose entries are released when read: ``reply[key]`` removes the entry.

    Releasing each entry after its only read keeps about one copy. A second read of the same key raises.
    """

    __slots__ = ("released",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released: set[Any] = set()

    def __getitem__(self, key: Any) -> Any:
        if key in self.released:
            raise KeyError(
                f"spec_compat: reply entry {key!r} was already read and released (adapter 'rpc-reply-read-once'; "
                "disable it if this code reads an entry twice)"
            )
        value = self.pop(key)
        self.released.add(key)
        return value


def read_once(result: Any) -> Any:
    """A dict reply (rank k's, of speculators' RPC) as a ReadOnceReply; anything else as is."""
    return ReadOnceReply(result) if type(result) is dict else result


class ReadOnce(ExecutorHook):
    stage = CORE_STAGE + 10  # the mapped states' dict, before any reshaping for the caller

    def on_reply(self, executor: Any, call: RpcCall, result: Any) -> Any:
        return read_once(result) if call.reply_rank is not None else result


def apply_read_once_reply(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, ReadOnce())


def probe_read_once_reply(ctx: Context) -> Probe:
    generate = speculators_code.generator_module(ctx).VllmHiddenStatesGenerator.generate
    if not speculators_code.reads_unique_reply_once_per_key(generate):
        return Probe(False, "speculators does not read the captured-states reply once per key in a loop")
    return Probe(
        True,
        "speculators copies each reply entry (clone) while the whole reply stays referenced: ~2x the returned "
        "bytes in the driver; each entry is released after its read",
    )


RPC_REPLY_READ_ONCE = Adapter(
    id="rpc-reply-read-once",
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how="hook ReadOnce: a dict reply of speculators' RPCs becomes a read-once mapping",
    why=(
        "driver peak memory ~2x the returned bytes (benchmarks #5: 1.87x / 2.00x for 10k tokens x 4 layers): "
        "generate() clones every captured tensor while the whole reply stays referenced"
    ),
    vllm_change="none: speculators 0.4.x's generate() pattern (clone per request of a dict reply)",
    detect="AST: generate() reads the unique reply by key at one place, inside a for loop",
    delete_when="speculators releases the reply entries itself (or stops cloning tensors it owns)",
    side="driver",
    probe=probe_read_once_reply,
    apply=apply_read_once_reply,
)
