"""Per-call cost of the RPC deadline (adapter executor-rpc-deadline) on the CPU, without an engine.

spec_compat's executor subclass over a stand-in for vLLM's executor whose collective_rpc only
dequeues one reply per asked rank from a stand-in queue, so the figure is what the deadline adds:
the timeout keyword, the per-rank reply snapshot and the counting dequeue wrapper. Run:
python benchmarks/rpc_deadline.py [calls]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from spec_compat.adapters.driver.executor.executor import make_executor_class
from spec_compat.adapters.driver.executor.executor_all_ranks_reply import AllRanksReply
from spec_compat.adapters.driver.executor.executor_rpc_deadline import RpcDeadline


class Queue:
    def dequeue(self, timeout: float | None = None) -> Any:
        return ("ok", None)


class Base:
    def __init__(self, vllm_config: Any) -> None:
        self.response_mqs = [Queue() for _ in range(8)]  # TP=8
        self.workers: list[Any] = []

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None,
        non_block: bool = False, unique_reply_rank: int | None = None,
    ) -> Any:  # fmt: skip
        queues = self.response_mqs if unique_reply_rank is None else [self.response_mqs[unique_reply_rank]]
        return [q.dequeue(timeout=timeout) for q in queues]

    def shutdown(self) -> None:
        pass


def executor(timeout_s: float | None) -> Any:
    cls = make_executor_class(type(f"Base{timeout_s}", (Base,), {}))
    cls.extension_methods = frozenset({"_get_captured_states"})
    cls.hooks = cls.hooks.adding(AllRanksReply())
    if timeout_s is not None:
        cls.hooks = cls.hooks.adding(RpcDeadline(timeout_s))
    return cls(vllm_config=object())


def per_call_us(ex: Any, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        ex.collective_rpc("_get_captured_states", unique_reply_rank=0)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    off, on = executor(None), executor(1800.0)
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(21):  # interleaved, minimum of each: the machine is shared
        runs["off"].append(per_call_us(off, calls))
        runs["on"].append(per_call_us(on, calls))
    base, with_deadline = min(runs["off"]), min(runs["on"])
    print(f"medians: off {statistics.median(runs['off']):.2f} us, on {statistics.median(runs['on']):.2f} us")
    print(f"TP=8 speculators RPC through spec_compat's executor: {base:.2f} us/call without the deadline, "
          f"{with_deadline:.2f} us/call with it: +{with_deadline - base:.2f} us/call "
          f"(8 counted replies + the snapshot)")  # fmt: skip
    on.shutdown()


if __name__ == "__main__":
    main()
