"""A driver process interrupted in the middle of generate() (run as a subprocess by tests/test_hang.py).

Usage: python tests/cells/signal_client.py MODEL_DIR OUT_JSON MARKER
Starts a TP=2 generator, writes {"driver": pid, "workers": [pids]} to OUT_JSON, makes rank 0's
_get_captured_states sleep for two minutes (after touching MARKER, so the test knows the call is in
flight) and calls generate(). The test then sends SIGINT or SIGTERM to this process.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
from typing import Any


def make_slow(marker: str) -> Any:
    def slow_on_rank_0(worker: Any) -> None:
        from vllm.distributed import get_tp_group

        if int(get_tp_group().rank_in_group) == 0:

            def slow_get_captured_states(*args: Any, **kwargs: Any) -> None:
                import time

                open(marker, "w").close()
                time.sleep(120)

            worker.worker._get_captured_states = slow_get_captured_states

    return slow_on_rank_0


def main() -> None:
    model, out_path, marker = sys.argv[1:4]
    # A shell that starts a job in the background makes it ignore SIGINT; a terminal does not.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import spec_compat

    spec_compat.apply(dtype="float32")
    from speculators.data_generation import VllmHiddenStatesGenerator

    generator = VllmHiddenStatesGenerator(model, layer_ids=[0, 2], max_model_len=128, tensor_parallel_size=2)
    executor = generator.executor
    with open(out_path, "w") as handle:
        json.dump({"driver": os.getpid(), "workers": [h.proc.pid for h in executor.workers]}, handle)
    executor.collective_rpc(make_slow(marker))
    # vLLM imports ray when it is installed (the test venv has it, for extract --replicas), and ray's
    # atexit shutdown hook turns the interpreter's exit-by-SIGINT after an uncaught KeyboardInterrupt
    # into status 1; what this client checks is spec_compat's shutdown under the interpreter's own exit.
    if "ray" in sys.modules:
        atexit.unregister(sys.modules["ray"].shutdown)
    generator.generate([[5, 6, 7, 8], [9, 10, 11]])
    print("generate() returned: the signal did not stop it", flush=True)


if __name__ == "__main__":
    main()
