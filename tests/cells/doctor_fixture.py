"""Run ``spec-compat doctor`` (or apply(strict=True)) after removing a vLLM feature, as a future vLLM might."""

from __future__ import annotations

import sys


def main() -> int:
    mode = sys.argv[1]
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    # A vLLM whose executor lost sample_tokens(): speculators 0.4 calls it.
    for klass in MultiprocExecutor.__mro__:
        if "sample_tokens" in vars(klass):
            delattr(klass, "sample_tokens")
    if mode == "strict":
        import spec_compat

        try:
            spec_compat.apply(strict=True)
        except spec_compat.IncompatibleError as exc:
            print(f"IncompatibleError: {exc}")
            return 1
        return 0
    from spec_compat.cli import main as cli_main

    return cli_main(["doctor", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
