"""Does vLLM itself agree with HF transformers on a model? (no speculators, no spec_compat)

    python tools/matrix_llm_check.py MODEL_DIR [--out FILE]

Run by tools/matrix.py inside a release's venv when an engine cell's hidden states differ from HF:
the prompt log-probabilities of vLLM's own ``LLM.generate`` are compared with HF's for the suite's
prompts. If vLLM alone disagrees too, the mismatch is the release's, not the shim's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    from engine_harness import prompts
    from tiny_models import load_hf_model

    all_prompts = [p for p in prompts() if len(p) > 1]
    llm = LLM(args.model, dtype="float32", enforce_eager=True, max_model_len=256)
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in all_prompts],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
    )
    hf = load_hf_model(Path(args.model))
    worst = 0.0
    for ids, output in zip(all_prompts, outputs, strict=True):
        with torch.inference_mode():
            logprobs = hf(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for position in range(1, len(ids)):
            entry = output.prompt_logprobs[position]
            got = entry[ids[position]].logprob
            want = float(logprobs[position - 1, ids[position]])
            worst = max(worst, abs(got - want))
    result = {"max_abs_logprob_diff": worst, "prompts": len(all_prompts)}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
