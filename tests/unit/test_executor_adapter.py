"""spec_compat's executor subclass against the old (list) and new (bare) collective_rpc reply shapes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from spec_compat.adapters.driver.executor.executor import WorkerSetup, make_executor_class
from spec_compat.adapters.driver.executor.executor_all_ranks_reply import AllRanksReply
from spec_compat.adapters.driver.executor.executor_model_runner_v1 import ForceV1ModelRunner
from spec_compat.adapters.driver.executor.executor_reply_shape import ReplyAsList
from spec_compat.adapters.driver.executor.executor_sample_tokens import SampleAfterExecute
from spec_compat.adapters.driver.executor.hooks import ExecutorHook
from spec_compat.adapters.driver.executor.worker_malloc_retain import WORKER_MALLOC_ENV, WorkerMalloc
from spec_compat.adapters.remote_errors import encode
from spec_compat.errors import WorkerError
from spec_compat.options import WORKER_ENV


class FakeExecutor:
    """Two ranks; rank r answers (method, r). ``bare``: vLLM >= 0.11.2 reply shape."""

    bare = True
    fail_rank: int | None = None

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.env_seen = {k: os.environ.get(k) for k in (WORKER_ENV, "VLLM_USE_V2_MODEL_RUNNER")}
        self.malloc_seen = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}

    def collective_rpc(
        self,
        method: str,
        timeout: Any = None,
        args: tuple[Any, ...] = (),
        kwargs: Any = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        ranks = [0, 1] if unique_reply_rank is None else [unique_reply_rank]
        for rank in ranks:
            if rank == self.fail_rank:
                raise RuntimeError(f"Worker failed with error '{encode(AssertionError(), rank, method)}'")
        replies = [(method, rank) for rank in ranks]
        if unique_reply_rank is None:
            return replies
        return replies[0] if self.bare else replies

    def execute_model(self, scheduler_output: Any) -> Any:
        return None

    def sample_tokens(self, grammar_output: Any) -> str:
        return "sampled"


def _subclass(base: type, *hooks: ExecutorHook) -> type:
    """The subclass with ``hooks`` registered, as their adapters' applies would."""
    cls = make_executor_class(base)
    for hook in hooks:
        cls.hooks = cls.hooks.adding(hook)
    cls.extension_methods = frozenset({"_get_captured_states"})
    return cls


@pytest.mark.parametrize("bare", [True, False])
def test_reply_shape_for_speculators_030(bare: bool) -> None:
    base = type(f"Base{bare}", (FakeExecutor,), {"bare": bare})
    executor = _subclass(base, ReplyAsList(), AllRanksReply())(vllm_config=object())
    # every rank is asked, rank 0's reply is handed back as the one-element list 0.3.0 indexes
    assert executor.collective_rpc("_get_captured_states", unique_reply_rank=0) == [("_get_captured_states", 0)]
    # vLLM's own RPCs are untouched
    assert executor.collective_rpc("execute_model", unique_reply_rank=0) == (
        ("execute_model", 0) if bare else [("execute_model", 0)]
    )


def test_failure_on_a_non_reply_rank_is_reported() -> None:
    base = type("BaseFail", (FakeExecutor,), {"fail_rank": 1})
    quiet = _subclass(type("BaseFailQuiet", (base,), {}))(vllm_config=object())
    assert quiet.collective_rpc("_get_captured_states", unique_reply_rank=0) == ("_get_captured_states", 0)
    loud = _subclass(base, AllRanksReply())(vllm_config=object())
    with pytest.raises(WorkerError, match="TP rank 1"):
        loud.collective_rpc("_get_captured_states", unique_reply_rank=0)


def test_sample_tokens_follows_execute_model_only_when_switched_on() -> None:
    on = _subclass(type("BaseSample", (FakeExecutor,), {}), SampleAfterExecute())(vllm_config=object())
    assert on.execute_model(type("SO", (), {"num_scheduled_tokens": {"a": 3}})()) == "sampled"
    assert on.step_log == [[("a", 3)]]


def test_worker_env_is_scoped_to_worker_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cls = _subclass(type("BaseEnv", (FakeExecutor,), {}), WorkerSetup('{"dtype": null}'), ForceV1ModelRunner())
    executor = cls(vllm_config=object())
    assert executor.env_seen == {WORKER_ENV: '{"dtype": null}', "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert WORKER_ENV not in os.environ and "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_worker_malloc_env_scoped_and_user_values_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, _ in WORKER_MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MALLOC_TOP_PAD_", "12345")  # the user's choice wins
    cls = _subclass(type("BaseMalloc", (FakeExecutor,), {}), WorkerMalloc(WORKER_MALLOC_ENV))
    executor = cls(vllm_config=object())
    expected = {key: value for key, value in WORKER_MALLOC_ENV} | {"MALLOC_TOP_PAD_": "12345"}
    assert executor.malloc_seen == expected
    assert {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")} == {"MALLOC_TOP_PAD_": "12345"}


def test_shutdown_destroys_message_queue_contexts_without_lingering() -> None:
    """A queue whose socket holds an undeliverable message: its context's term() would block forever."""
    import threading
    from types import SimpleNamespace

    import zmq

    from spec_compat.adapters.driver.executor.executor_close_queues import close_message_queues, message_queues

    def queue() -> Any:
        context = zmq.Context()
        pending = context.socket(zmq.PUSH)
        pending.setsockopt(zmq.LINGER, -1)
        pending.connect("ipc:///tmp/spec-compat-no-such-peer")
        pending.send(b"never delivered")
        notify = context.socket(zmq.PUB)
        return SimpleNamespace(local_socket=pending, _spin_condition=SimpleNamespace(local_notify_socket=notify))

    broadcast, response = queue(), queue()
    executor = SimpleNamespace(
        rpc_broadcast_mq=broadcast, response_mqs=[response], workers=[SimpleNamespace(worker_response_mq=response)]
    )
    done = threading.Event()
    queues = message_queues(executor)
    assert queues == [broadcast, response]
    thread = threading.Thread(target=lambda: (close_message_queues(queues), done.set()), daemon=True)
    thread.start()
    assert done.wait(10), "closing the queues blocked"
    for q in (broadcast, response):
        assert q.local_socket.closed and q._spin_condition.local_notify_socket.closed
        assert q.local_socket.context.closed
    close_message_queues(queues)  # idempotent: a second shutdown finds everything closed


def test_shutdown_closes_queues_only_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from spec_compat.adapters.driver.executor import executor_close_queues

    calls: list[Any] = []
    monkeypatch.setattr(executor_close_queues, "close_message_queues", calls.append)
    queue = object()

    class Base:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def shutdown(self) -> str:
            self.rpc_broadcast_mq = None  # as vLLM does: the queues are gone after shutdown()
            return "base"

    cls = make_executor_class(Base)
    instance = cls.__new__(cls)
    instance.rpc_broadcast_mq = queue
    assert instance.shutdown() == "base" and calls == []
    instance.rpc_broadcast_mq = queue
    saved = cls.hooks
    cls.hooks = saved.adding(executor_close_queues.CloseQueues())
    try:
        assert instance.shutdown() == "base" and calls == [[queue]]
    finally:
        cls.hooks = saved


@pytest.mark.parametrize(
    ("method", "cuda_initialised", "expected"),
    [
        (None, True, {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),  # vLLM's default is fork
        ("fork", True, {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
        ("fork", False, {}),
        ("spawn", True, {}),
    ],
)
def test_fork_falls_back_to_spawn_only_after_cuda_init(
    monkeypatch: pytest.MonkeyPatch, method: str | None, cuda_initialised: bool, expected: dict[str, str]
) -> None:
    from spec_compat.adapters.driver.executor import fork

    if method is None:
        monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    else:
        monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", method)
    monkeypatch.setattr(fork, "cuda_driver_initialized", lambda: cuda_initialised)
    assert fork.start_method_env() == expected


def test_cuda_driver_check_loads_nothing() -> None:
    """On a machine without a loaded libcuda the check answers False and does not load it."""
    from spec_compat.adapters.driver.executor.fork import cuda_driver_initialized

    maps_file = Path("/proc/self/maps")
    maps = maps_file.read_text() if maps_file.exists() else ""
    if "libcuda.so" in maps:
        pytest.skip("libcuda is loaded in this process")
    assert cuda_driver_initialized() is False
    after = maps_file.read_text() if maps else ""
    assert "libcuda.so" not in after


def test_read_once_reply_releases_each_entry_and_refuses_a_second_read() -> None:
    from spec_compat.adapters.driver.executor.rpc_reply_read_once import ReadOnceReply

    reply = ReadOnceReply({"req_0": [1], "req_1": [2]})
    assert "req_0" in reply and len(reply) == 2 and sorted(reply.keys()) == ["req_0", "req_1"]
    assert reply["req_0"] == [1]
    assert "req_0" not in reply and len(reply) == 1  # released: the driver no longer holds it
    with pytest.raises(KeyError, match="already read and released"):
        reply["req_0"]
    with pytest.raises(KeyError, match="req_9"):
        reply["req_9"]


def test_read_once_reply_only_for_dict_replies_of_speculators_rpcs() -> None:
    from spec_compat.adapters.driver.executor.rpc_reply_read_once import ReadOnce, ReadOnceReply

    class Base:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
            return {"dict": {"a": 1}, "list": [1, 2]}[kwargs.get("kind", "dict")]

    cls = make_executor_class(Base)
    instance = cls.__new__(cls)
    cls.extension_methods = frozenset({"_get_captured_states"})
    saved = cls.hooks
    cls.hooks = saved.adding(ReadOnce())
    try:
        assert type(instance.collective_rpc("_get_captured_states", unique_reply_rank=0)) is ReadOnceReply
        assert type(instance.collective_rpc("_get_captured_states", unique_reply_rank=0, kind="list")) is list
        assert type(instance.collective_rpc("_get_captured_states")) is dict  # every rank's reply: untouched
        assert type(instance.collective_rpc("get_kv_cache_spec", unique_reply_rank=0)) is dict  # vLLM's own RPC
    finally:
        cls.hooks = saved
        cls.extension_methods = frozenset()


READ_ONCE_SOURCES = {
    # speculators 0.4.x shape: one keyed read inside the loop over request ids
    "keyed_in_loop": (
        "def generate(self, ids):\n"
        "    states = self.executor.collective_rpc('_get_captured_states', unique_reply_rank=0)\n"
        "    if not states:\n        raise RuntimeError\n"
        "    out = []\n"
        "    for req_id in sorted(ids):\n"
        "        if req_id not in states:\n            raise RuntimeError(list(states.keys()))\n"
        "        out.append([h.clone() for h in states[req_id]])\n"
        "    return out\n",
        True,
    ),
    # speculators 0.3.0 shape: constant index, then slices of the same tensors
    "constant_index": (
        "def generate(self, ids):\n"
        "    states = self.executor.collective_rpc('_get_captured_states', unique_reply_rank=0)\n"
        "    layers = states[0]\n"
        "    return [[h[0:1].clone() for h in layers] for _ in ids]\n",
        False,
    ),
    "read_twice": (
        "def generate(self, ids):\n"
        "    states = self.executor.collective_rpc('_get_captured_states', unique_reply_rank=0)\n"
        "    for req_id in ids:\n        print(states[req_id])\n"
        "    return [states[req_id] for req_id in ids]\n",
        False,
    ),
    "outside_loop": (
        "def generate(self, ids):\n"
        "    states = self.executor.collective_rpc('_get_captured_states', unique_reply_rank=0)\n"
        "    key = ids[0]\n"
        "    return states[key]\n",
        False,
    ),
}


@pytest.mark.parametrize("name", list(READ_ONCE_SOURCES))
def test_read_once_probe_reads_the_generator_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    import importlib

    from spec_compat.adapters import speculators_code

    source, expected = READ_ONCE_SOURCES[name]
    (tmp_path / f"read_once_{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(f"read_once_{name}")
    assert speculators_code.reads_unique_reply_once_per_key(module.generate) is expected


def test_close_queues_probe_reads_whether_vllm_closes_sockets_itself() -> None:
    import ast

    from spec_compat.adapters.driver.executor.executor_close_queues import closes_sockets_without_linger

    assert closes_sockets_without_linger(ast.parse("def f(s):\n    s.close(linger=0)\n"))  # vLLM >= 0.32 shape
    assert not closes_sockets_without_linger(ast.parse("def f(s):\n    s.close()\n    s.close(linger=5)\n"))


class _Process:
    def __init__(self, pid: int, exitcode: int | None) -> None:
        self.pid, self.exitcode = pid, exitcode


class _Handle:
    def __init__(self, rank: int, exitcode: int | None) -> None:
        self.rank, self.proc = rank, _Process(1000 + rank, exitcode)


def test_a_dead_worker_is_named_before_the_error_its_peer_raised_after_it() -> None:
    """Rank 1 killed: rank 0 then fails in its collective ("connection closed by peer") and that
    reply may reach the caller first; the cause named is the death, rank 0's error kept with it."""
    from spec_compat.adapters.driver.executor.failures import diagnosed

    executor = type("Executor", (), {})()
    peer_error = RuntimeError(f"Worker failed with error '{encode(RuntimeError('Connection closed by peer'), 0, 'm')}'")
    executor.workers = [_Handle(0, None), _Handle(1, -9)]
    died = diagnosed(executor, peer_error, "execute_model", {})
    assert isinstance(died, WorkerError) and died.exc_type == "WorkerProcessDied" and died.rank == 1
    assert "rank 1 (pid 1001) killed by signal 9 (SIGKILL)" in died.message
    assert "then TP rank 0 raised RuntimeError: Connection closed by peer" in died.message
    assert "TP rank 0's traceback" in died.remote_traceback
    executor.workers = [_Handle(0, None), _Handle(1, None)]  # every worker alive: the error itself
    alive = diagnosed(executor, peer_error, "execute_model", {"unique_reply_rank": 0})
    assert isinstance(alive, WorkerError) and alive.exc_type == "RuntimeError" and alive.rank == 0
