"""Baseline for the state test: vLLM's own engine (no speculators, no spec_compat) on the same call
sequence, so worker RSS growth can be attributed. Usage: python tests/cells/llm_rss_cell.py MODEL TP CALLS OUT"""

from __future__ import annotations

import json
import random
import sys


def main() -> None:
    import psutil
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, tp, calls, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = LLM(model, dtype="float32", enforce_eager=True, tensor_parallel_size=tp, max_model_len=256,
              enable_prefix_caching=False)  # fmt: skip
    rng = random.Random(3)  # the same pool and call sequence as state_cell.py
    pool = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 120))] for _ in range(24)]
    params = SamplingParams(max_tokens=1, temperature=0)
    for prompt in pool:
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)

    def worker_rss() -> list[int]:
        children = psutil.Process().children(recursive=True)
        return sorted(p.memory_info().rss for p in children)[-tp:]

    record: dict[str, object] = {}
    for call in range(calls):
        picks = [rng.randrange(len(pool)) for _ in range(rng.randrange(1, 14))]
        llm.generate([TokensPrompt(prompt_token_ids=pool[i]) for i in picks], params, use_tqdm=False)
        if call == 9:
            record["rss_after_10"] = worker_rss()
    record["rss_end"] = worker_rss()
    with open(out_path, "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    main()
