"""The RPC deadline (adapter executor-rpc-deadline), its option, and the hang report, against a fake
two-rank executor; the real-engine cases are in tests/test_hang.py."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from spec_compat.adapters.driver.executor import executor_rpc_deadline
from spec_compat.adapters.driver.executor.executor import make_executor_class
from spec_compat.adapters.driver.executor.executor_all_ranks_reply import AllRanksReply
from spec_compat.errors import EngineStopped, WorkerError, WorkerTimeout
from spec_compat.options import DEFAULT_RPC_TIMEOUT_S, RPC_TIMEOUT_ENV, Options

# ---- option parsing and validation ------------------------------------------------------------------


def test_default_env_and_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RPC_TIMEOUT_ENV, raising=False)
    assert Options.from_env().rpc_timeout_s == DEFAULT_RPC_TIMEOUT_S == 1800.0
    monkeypatch.setenv(RPC_TIMEOUT_ENV, " 90.5 ")
    assert Options.from_env().rpc_timeout_s == 90.5
    assert Options.from_env(rpc_timeout_s=7).rpc_timeout_s == 7.0  # the argument wins over the environment
    monkeypatch.setenv(RPC_TIMEOUT_ENV, "")
    assert Options.from_env().rpc_timeout_s == DEFAULT_RPC_TIMEOUT_S


@pytest.mark.parametrize("text", ["soon", "0", "-5", "inf", "nan", "1e400"])
def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(RPC_TIMEOUT_ENV, text)
    with pytest.raises(ValueError, match=RPC_TIMEOUT_ENV):
        Options.from_env()


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
     (True, TypeError), ("30", TypeError), ([30], TypeError)],
)  # fmt: skip
def test_bad_argument_is_refused(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="rpc_timeout_s"):
        Options(rpc_timeout_s=value)


def test_options_reach_the_workers_unchanged() -> None:
    options = Options(rpc_timeout_s=12.5)
    assert json.loads(options.to_json())["rpc_timeout_s"] == 12.5
    assert Options.from_json(options.to_json()) == options


# ---- the executor: which calls get a deadline, and what a timeout reports --------------------------


class FakeQueue:
    def __init__(self, rank: int, executor: FakeExecutor) -> None:
        self.rank = rank
        self.executor = executor

    def dequeue(self, timeout: float | None = None) -> Any:
        if self.rank in self.executor.silent:
            raise TimeoutError
        if self.executor.pending[self.rank] <= 0:
            raise TimeoutError  # nothing queued
        self.executor.pending[self.rank] -= 1
        return ("ok", self.rank)


class FakeProc:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        self.exitcode = -signal.SIGTERM

    def kill(self) -> None:
        self.exitcode = -signal.SIGKILL


class FakeHandle:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc = FakeProc()


class FakeExecutor:
    """Two ranks that answer in rank order through their response queues, like vLLM's executor;
    ranks in ``silent`` never answer (the dequeue times out)."""

    def __init__(self, vllm_config: Any) -> None:
        self.silent: set[int] = set()
        self.pending = [0, 0]
        self.response_mqs = [FakeQueue(0, self), FakeQueue(1, self)]
        self.workers = [FakeHandle(0), FakeHandle(1)]
        self.timeouts: list[tuple[str, Any]] = []
        self.shut_down = False
        self.is_failed = False

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Any = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        self.timeouts.append((method, timeout))
        ranks = [0, 1] if unique_reply_rank is None else [unique_reply_rank]
        for rank in ranks:
            self.pending[rank] += 1
        replies = [mq.dequeue(timeout=timeout)[1] for mq in (self.response_mqs[r] for r in ranks)]
        return replies if unique_reply_rank is None else replies[0]

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.collective_rpc("execute_model", unique_reply_rank=0, timeout=300)

    def shutdown(self) -> None:
        self.shut_down = True


def _executor(timeout_s: float | None = 5.0) -> Any:
    """The executor with the hooks of executor-all-ranks-reply and (unless ``timeout_s`` is None)
    executor-rpc-deadline registered, as their applies would."""
    base = type(f"Base{timeout_s}", (FakeExecutor,), {})
    cls = make_executor_class(base)
    cls.extension_methods = frozenset({"_get_captured_states", "_setup_hidden_states_capture", "_reset_capture"})
    cls.hooks = cls.hooks.adding(AllRanksReply())
    if timeout_s is not None:
        cls.hooks = cls.hooks.adding(executor_rpc_deadline.RpcDeadline(timeout_s))
    return cls(vllm_config=object())


def test_deadline_only_on_generate_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(executor_rpc_deadline.STEP_TIMEOUT_ENV, raising=False)
    executor = _executor(5.0)
    executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
    executor.collective_rpc("_reset_capture")
    executor.collective_rpc("_setup_hidden_states_capture")  # engine load: no deadline
    executor.collective_rpc("load_model")
    executor.execute_model(type("SO", (), {"num_scheduled_tokens": {}})())  # vLLM's 300 s is replaced
    assert executor.timeouts == [
        ("_get_captured_states", 5.0),
        ("_reset_capture", 5.0),
        ("_setup_hidden_states_capture", None),
        ("load_model", None),
        ("execute_model", 5.0),
    ]
    assert executor.replies_read == [5, 4]  # every reply read from each rank's queue is counted
    directory = executor.watchdog_directory
    assert os.path.isdir(directory)
    executor.shutdown()
    assert not os.path.exists(directory)


def test_user_set_step_timeout_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(executor_rpc_deadline.STEP_TIMEOUT_ENV, "300")
    executor = _executor(1000.0)
    executor.execute_model(type("SO", (), {"num_scheduled_tokens": {}})())
    assert executor.timeouts == [("execute_model", 300)]


def test_no_deadline_when_switched_off() -> None:
    executor = _executor(None)
    executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
    assert executor.timeouts == [("_get_captured_states", None)] and not hasattr(executor, "watchdog_directory")


@pytest.mark.parametrize("silent", [0, 1])
def test_timeout_names_the_silent_rank_and_stops_the_engine(silent: int) -> None:
    executor = _executor(5.0)
    executor.silent = {silent}
    directory = executor.watchdog_directory
    started = time.monotonic()
    with pytest.raises(WorkerTimeout) as caught:
        executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
    error = caught.value
    assert isinstance(error, WorkerError) and error.rank == silent and error.method == "_get_captured_states"
    assert error.stuck == [silent] and error.answered == [1 - silent]
    assert f"answered: TP rank {1 - silent}; no reply: TP rank {silent}" in str(error)
    assert f"TP rank {silent} (pid {os.getpid()}): alive" in str(error) and "NO REPLY" in str(error)
    assert f"TP rank {silent}: Python stack at the deadline" in str(error)  # (no dump: no worker adapter here)
    assert list(error.stacks) == [silent]
    assert "no worker process left" in str(error) and executor.shut_down and executor.is_failed
    assert not os.path.exists(directory)
    assert time.monotonic() - started < 10
    with pytest.raises(EngineStopped, match="create a new VllmHiddenStatesGenerator"):
        executor.collective_rpc("_reset_capture")


def test_process_state_of_an_exited_process() -> None:
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=os._exit, args=(3,))
    proc.start()
    proc.join(30)
    assert executor_rpc_deadline.process_state(proc) == "exited with code 3"
    assert executor_rpc_deadline.describe_exit(-9) == "killed by signal 9 (SIGKILL)"


def test_stack_dump_through_faulthandler(tmp_path: Any) -> None:
    """The worker-side registration and the driver-side read, in a child process."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c",
         "import faulthandler, os, signal, sys, time\n"
         f"f = open(os.path.join({str(tmp_path)!r}, f'{{os.getpid()}}.stack'), 'a')\n"
         "faulthandler.register(signal.SIGUSR2, file=f, all_threads=True, chain=False)\n"
         "def sleeping_here():\n    print('ready', flush=True)\n    time.sleep(60)\n"
         "sleeping_here()\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        stacks = executor_rpc_deadline.take_stacks({3: child.pid}, str(tmp_path))
    finally:
        child.kill()
        child.wait()
    assert "in sleeping_here" in stacks[3], stacks
